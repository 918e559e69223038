//! A table's storage, [`TableStore`]: where its rows and optimizer state
//! live behind the rows the kernels address. Two implementations:
//! [`InMemory`] (the resident rows are the table) and [`OnDisk`] (a file
//! behind a cache: the resident rows are the cache's slots, filled by
//! staging a batch, see `tier`). The kernels see the resident rows either
//! way, and everything else a table does goes through the trait.

use crate::optimizer::OptimizerState;
use crate::rows::TableRows;
use crate::tier::DiskTier;
use crate::SparseError;

/// Where a table's rows live. Ids and lengths are checked by the table
/// before a call; `name` is the table's, for errors.
pub(crate) trait TableStore: std::fmt::Debug + Send + Sync {
    /// The rows the kernels address, and their optimizer state.
    fn resident(&self) -> (&TableRows, &OptimizerState);
    /// The same, mutable, with the disk tier behind them (`None`: the
    /// resident rows are the table): what staging and the backward use.
    fn parts_mut(&mut self) -> (&mut TableRows, &mut OptimizerState, Option<&mut DiskTier>);
    /// The disk tier behind the resident rows, if any.
    fn tier(&self) -> Option<&DiskTier>;
    /// Row `id`'s values as fp32.
    fn read_row(&self, name: &str, id: usize, out: &mut [f32]) -> Result<(), SparseError>;
    /// Sets row `id` to `values` (rounded to the type).
    fn write_row(&mut self, name: &str, id: usize, values: &[f32]) -> Result<(), SparseError>;
    /// Rows `first..` as stored, and their state (as many as `rows` holds).
    fn read_stored(
        &self,
        name: &str,
        first: usize,
        rows: &mut [u8],
        state: &mut [f32],
    ) -> Result<(), SparseError>;
    /// Sets rows `first..` as stored, and their state.
    fn write_stored(
        &mut self,
        name: &str,
        first: usize,
        rows: &[u8],
        state: &[f32],
    ) -> Result<(), SparseError>;
    /// Writes the changed resident rows to where the rows live.
    fn flush(&mut self, name: &str) -> Result<(), SparseError>;
}

/// A table in memory: its resident rows are all of it.
#[derive(Debug)]
pub(crate) struct InMemory {
    pub(crate) rows: TableRows,
    pub(crate) state: OptimizerState,
}

impl TableStore for InMemory {
    fn resident(&self) -> (&TableRows, &OptimizerState) {
        (&self.rows, &self.state)
    }
    fn parts_mut(&mut self) -> (&mut TableRows, &mut OptimizerState, Option<&mut DiskTier>) {
        (&mut self.rows, &mut self.state, None)
    }
    fn tier(&self) -> Option<&DiskTier> {
        None
    }
    fn read_row(&self, _: &str, id: usize, out: &mut [f32]) -> Result<(), SparseError> {
        self.rows.read_row(id, out);
        Ok(())
    }
    fn write_row(&mut self, _: &str, id: usize, values: &[f32]) -> Result<(), SparseError> {
        self.rows.write_row(id, values);
        Ok(())
    }
    fn read_stored(
        &self,
        _: &str,
        first: usize,
        rows: &mut [u8],
        state: &mut [f32],
    ) -> Result<(), SparseError> {
        let (stride, per_row) = (self.rows.stride(), self.state.floats_per_row());
        let n = rows.len() / stride.max(1);
        rows.copy_from_slice(&self.rows.bytes()[first * stride..(first + n) * stride]);
        state.copy_from_slice(&self.state.as_slice()[first * per_row..(first + n) * per_row]);
        Ok(())
    }
    fn write_stored(
        &mut self,
        _: &str,
        first: usize,
        rows: &[u8],
        state: &[f32],
    ) -> Result<(), SparseError> {
        let (stride, per_row) = (self.rows.stride(), self.state.floats_per_row());
        let n = rows.len() / stride.max(1);
        self.rows.bytes_mut()[first * stride..(first + n) * stride].copy_from_slice(rows);
        let kept = self.state.as_mut_slice();
        kept[first * per_row..(first + n) * per_row].copy_from_slice(state);
        Ok(())
    }
    fn flush(&mut self, _: &str) -> Result<(), SparseError> {
        Ok(())
    }
}

/// A table on the disk tier: its rows and state in a file (one record
/// per row), the resident rows the cache's slots.
#[derive(Debug)]
pub(crate) struct OnDisk {
    pub(crate) rows: TableRows,
    pub(crate) state: OptimizerState,
    pub(crate) tier: DiskTier,
}

impl OnDisk {
    /// Bytes of a row and of its state.
    fn sizes(&self) -> (usize, usize) {
        (self.rows.stride(), 4 * self.state.floats_per_row())
    }
}

impl TableStore for OnDisk {
    fn resident(&self) -> (&TableRows, &OptimizerState) {
        (&self.rows, &self.state)
    }
    fn parts_mut(&mut self) -> (&mut TableRows, &mut OptimizerState, Option<&mut DiskTier>) {
        (&mut self.rows, &mut self.state, Some(&mut self.tier))
    }
    fn tier(&self) -> Option<&DiskTier> {
        Some(&self.tier)
    }
    fn read_row(&self, name: &str, id: usize, out: &mut [f32]) -> Result<(), SparseError> {
        if let Some(slot) = self.tier.slot_of(id as u64) {
            self.rows.read_row(slot, out);
            return Ok(());
        }
        let (row, state) = self.sizes();
        let mut record = vec![0u8; row + state];
        self.tier.read_records(name, id as u64, &mut record)?;
        self.rows.dtype().decode_row(&record[..row], out);
        Ok(())
    }
    fn write_row(&mut self, name: &str, id: usize, values: &[f32]) -> Result<(), SparseError> {
        if let Some(slot) = self.tier.slot_of(id as u64) {
            self.tier.mark_changed(&[slot as i64]);
            self.rows.write_row(slot, values);
            return Ok(());
        }
        let mut bytes = vec![0u8; self.rows.stride()];
        crate::rows::encode(self.rows.dtype(), values, &mut bytes);
        self.tier.write_row_bytes(name, id as u64, &bytes)
    }
    /// The file's records, with the cache's rows over them (the newer:
    /// they may not be written back).
    fn read_stored(
        &self,
        name: &str,
        first: usize,
        rows: &mut [u8],
        state: &mut [f32],
    ) -> Result<(), SparseError> {
        let (stride, state_len) = self.sizes();
        let (record, per_row) = (stride + state_len, state_len / 4);
        let n = rows.len() / stride.max(1);
        let mut records = vec![0u8; n * record];
        self.tier.read_records(name, first as u64, &mut records)?;
        let state_bytes: &mut [u8] = bytemuck::cast_slice_mut(state);
        for (r, rec) in records.chunks_exact(record).enumerate() {
            let (row, st) = (
                r * stride..(r + 1) * stride,
                r * state_len..(r + 1) * state_len,
            );
            match self.tier.slot_of((first + r) as u64) {
                Some(slot) => {
                    rows[row].copy_from_slice(&self.rows.bytes()[slot * stride..][..stride]);
                    let kept = &self.state.as_slice()[slot * per_row..][..per_row];
                    state_bytes[st].copy_from_slice(bytemuck::cast_slice(kept));
                }
                None => {
                    rows[row].copy_from_slice(&rec[..stride]);
                    state_bytes[st].copy_from_slice(&rec[stride..]);
                }
            }
        }
        Ok(())
    }
    /// To the file, and to the cache where cached.
    fn write_stored(
        &mut self,
        name: &str,
        first: usize,
        rows: &[u8],
        state: &[f32],
    ) -> Result<(), SparseError> {
        let (stride, state_len) = self.sizes();
        let (record, per_row) = (stride + state_len, state_len / 4);
        let n = rows.len() / stride.max(1);
        let state_bytes: &[u8] = bytemuck::cast_slice(state);
        let mut records = vec![0u8; n * record];
        for (r, rec) in records.chunks_exact_mut(record).enumerate() {
            rec[..stride].copy_from_slice(&rows[r * stride..(r + 1) * stride]);
            rec[stride..].copy_from_slice(&state_bytes[r * state_len..(r + 1) * state_len]);
            if let Some(slot) = self.tier.slot_of((first + r) as u64) {
                self.rows.bytes_mut()[slot * stride..][..stride].copy_from_slice(&rec[..stride]);
                let kept = &mut self.state.as_mut_slice()[slot * per_row..][..per_row];
                kept.copy_from_slice(&state[r * per_row..(r + 1) * per_row]);
            }
        }
        self.tier.write_records(name, first as u64, &records)
    }
    fn flush(&mut self, name: &str) -> Result<(), SparseError> {
        self.tier.flush(name, &mut self.rows, &mut self.state)
    }
}
