//! The Criteo Parquet schema: `label` int8, `int_0..int_12` int32 nullable
//! (raw values), `cat_0..cat_25` int64 nullable (the hexadecimal id parsed,
//! no modulo), or `list<int64>` for multi-hot features.

use std::sync::Arc;

use arrow_schema::{DataType, Field, Schema, SchemaRef};

/// Number of integer (dense) features: columns `int_0..int_12`.
pub const NUM_INT: usize = 13;
/// Number of categorical (sparse) features: columns `cat_0..cat_25`.
pub const NUM_CAT: usize = 26;
/// Name of the label column (int8, 0 or 1, never null).
pub const LABEL: &str = "label";

/// Name of integer feature `i`: `int_{i}` (int32, nullable, raw value).
pub fn int_column(i: usize) -> String {
    format!("int_{i}")
}

/// Name of categorical feature `i`: `cat_{i}` (int64 or `list<int64>`,
/// nullable; the raw hexadecimal id, not reduced).
pub fn cat_column(i: usize) -> String {
    format!("cat_{i}")
}

/// The type of a multi-hot categorical column.
pub fn id_list_type() -> DataType {
    DataType::List(Arc::new(Field::new("item", DataType::Int64, true)))
}

/// The schema, with `cat_i` a `list<int64>` where `multi_hot[i]`.
pub fn criteo_schema(multi_hot: &[bool; NUM_CAT]) -> SchemaRef {
    let mut fields = vec![Field::new(LABEL, DataType::Int8, false)];
    fields.extend((0..NUM_INT).map(|i| Field::new(int_column(i), DataType::Int32, true)));
    fields.extend((0..NUM_CAT).map(|i| {
        let t = if multi_hot[i] {
            id_list_type()
        } else {
            DataType::Int64
        };
        Field::new(cat_column(i), t, true)
    }));
    Arc::new(Schema::new(fields))
}
