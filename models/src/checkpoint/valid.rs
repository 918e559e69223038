//! Values a checkpoint may hold: finite weights and state, and accumulated
//! squares (Adagrad's sums, Adam's second moments) that are not negative.
//! Checked as the tensors are read, so a corrupt or diverged checkpoint is
//! refused with the tensor, row and column named, not trained or served.

use ember_sharding::RowSplit;
use ember_sparse::DataType;

/// Which values a tensor may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Allowed {
    /// Any finite value.
    Finite,
    /// Finite and not negative (sums of squares).
    NonNegative,
}

/// Why `v` is not allowed, if it is not.
fn fault(v: f32, allowed: Allowed) -> Option<&'static str> {
    if v.is_nan() {
        Some("NaN")
    } else if v.is_infinite() {
        Some("an infinite value")
    } else if allowed == Allowed::NonNegative && v < 0.0 {
        Some("a negative value (it accumulates squares)")
    } else {
        None
    }
}

/// The first value of `values` (`[rows, width]` of rows `split` of a tensor,
/// columns from `first_col`) that is not allowed, as a message naming its
/// row and column in the whole tensor.
pub(super) fn check_values(
    values: &[f32],
    width: usize,
    (split, first_col): (RowSplit, usize),
    allowed: Allowed,
) -> Result<(), String> {
    // The plain pass first: it vectorises, and nearly every check passes.
    let ok = match allowed {
        Allowed::Finite => values.iter().fold(true, |ok, v| ok & v.is_finite()),
        Allowed::NonNegative => {
            (values.iter()).fold(true, |ok, v| ok & (v.is_finite() & (*v >= 0.0)))
        }
    };
    if ok {
        return Ok(());
    }
    let (i, why) = (values.iter().enumerate())
        .find_map(|(i, &v)| fault(v, allowed).map(|why| (i, why)))
        .expect("the pass above found one");
    let (l, c) = (i / width.max(1), i % width.max(1));
    Err(format!(
        "row {}, column {} holds {why}",
        split.global(l),
        first_col + c
    ))
}

/// [`check_values`] for rows of `dtype` (`width` columns each), decoded
/// one at a time (the bytes may be unaligned, and a table is not copied).
pub(super) fn check_rows(
    dtype: DataType,
    bytes: &[u8],
    width: usize,
    (split, first_col): (RowSplit, usize),
) -> Result<(), String> {
    let stride = dtype.row_bytes(width).unwrap_or(0).max(1);
    let mut row = vec![0f32; width];
    for (l, src) in bytes.chunks_exact(stride).enumerate() {
        dtype.decode_row(src, &mut row);
        let start = split.global(l);
        let this_row = RowSplit::Block {
            start,
            end: start + 1,
        };
        check_values(&row, width, (this_row, first_col), Allowed::Finite)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_bad_value_is_named_by_row_and_column() {
        let all = (RowSplit::All, 0);
        assert!(check_values(&[0.0, -1.0, 2.0], 3, all, Allowed::Finite).is_ok());
        let e = check_values(&[0.0, 1.0, f32::NAN, 3.0], 2, all, Allowed::Finite);
        assert_eq!(e.unwrap_err(), "row 1, column 0 holds NaN");
        let e = check_values(&[0.0, -1.0], 1, (RowSplit::All, 4), Allowed::NonNegative);
        assert!(e
            .unwrap_err()
            .starts_with("row 1, column 4 holds a negative"));
        let e = check_values(&[f32::INFINITY], 1, all, Allowed::NonNegative);
        assert_eq!(e.unwrap_err(), "row 0, column 0 holds an infinite value");
        let rows = RowSplit::Block { start: 10, end: 12 };
        let e = check_values(&[0.0, f32::NAN], 1, (rows, 0), Allowed::Finite);
        assert_eq!(e.unwrap_err(), "row 11, column 0 holds NaN");
    }

    #[test]
    fn rows_of_every_type_are_decoded_to_be_checked() {
        for dtype in [
            DataType::Fp32,
            DataType::Fp16,
            DataType::Bf16,
            DataType::Int8,
        ] {
            let w = dtype.row_bytes(4).unwrap();
            let mut bytes = vec![0u8; 3 * w];
            for r in 0..3 {
                dtype.encode_row(&[1.0, 2.0, 3.0, 4.0], &mut bytes[r * w..(r + 1) * w]);
            }
            assert!(check_rows(dtype, &bytes, 4, (RowSplit::All, 0)).is_ok());
            match dtype {
                // The row's fp16 scale, NaN: every value decodes to NaN.
                DataType::Int8 => bytes[2 * w..2 * w + 2].copy_from_slice(&0x7e00u16.to_le_bytes()),
                _ => dtype.encode_row(&[1.0, 2.0, f32::NAN, 4.0], &mut bytes[2 * w..]),
            }
            let e = check_rows(dtype, &bytes, 4, (RowSplit::All, 0)).unwrap_err();
            assert!(e.starts_with("row 2, column"), "{dtype}: {e}");
        }
    }
}
