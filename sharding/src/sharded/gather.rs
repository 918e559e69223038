//! Gather-back: every shard's rows and optimizer state copied back into the
//! unsharded collection (`to_collection`), across ranks when on a rank.

use ember_sparse::{merge_shards, EmbeddingBagCollection, KvShard, KvState};

use super::codec::wire_err;
use super::layout::local_name;
use super::source::{copy_rows_back, ShardRows};
use super::{Exec, ShardedEmbeddingBagCollection};
use crate::plan::{RowSplit, ShardingType};
use crate::wire::{Reader, Writer};
use crate::ShardingError;

impl ShardedEmbeddingBagCollection {
    /// The unsharded collection: every shard's rows and state gathered back
    /// (data-parallel tables from device 0's replica). On a rank, every rank
    /// must call this together: the shards travel to every rank. A table
    /// sharded on the disk tier comes back on the disk tier (its tier as
    /// the collection was made), copied a piece at a time; on ranks that
    /// is refused (its rows would travel to every rank's memory).
    pub fn to_collection(&self) -> Result<EmbeddingBagCollection, ShardingError> {
        let on_disk = self.tiers.iter().position(Option::is_some);
        // Alike on every rank: all refuse together.
        if let (Some(t), Exec::Rank(_)) = (on_disk, &self.exec) {
            return Err(ShardingError::Source(format!(
                "table '{}' has shards on the disk tier: they are not gathered into every \
                 rank's memory (their checkpoint is a set of the shards, each streamed)",
                self.configs[t].name
            )));
        }
        // Zeroed, not initialised: the shards below cover every row and state float.
        let mut ebc = EmbeddingBagCollection::zeroed_with_disk_tiers(
            self.configs.clone(),
            self.optimizer,
            self.tiers.clone(),
        )?;
        // (table, shard index, shard) of every shard that is gathered.
        let wanted: Vec<(usize, usize, &crate::plan::Shard)> = (self.configs.iter().enumerate())
            .flat_map(|(t, c)| {
                let p = self.plan.table(&c.name).expect("validated");
                let dp = p.sharding == ShardingType::DataParallel;
                (p.shards.iter().enumerate())
                    .filter(move |(_, s)| !dp || s.device == 0)
                    .map(move |(k, s)| (t, k, s))
            })
            .collect();
        let local = |t: usize, k: usize, device: usize| {
            let d = self.device_index(device).expect("a shard of this process");
            (self.devices[d].ebc.as_ref())
                .and_then(|e| e.table(&local_name(&self.configs[t].name, k)))
                .expect("every shard has a local table")
        };
        // Each key-value table's shards' maps, made one below.
        let mut maps: Vec<Vec<KvShard>> = vec![Vec::new(); self.configs.len()];
        match &self.exec {
            Exec::Threads(_) => {
                // A disk-tier table makes the rows its shards still hold
                // initial, as the table they were sharded from made them.
                let made: Vec<bool> = (ebc.tables_mut().iter_mut().enumerate())
                    .map(|(t, global)| {
                        let maker = self.makers.get(t).and_then(Option::as_ref);
                        maker.is_some_and(|m| global.make_rows_like(m))
                    })
                    .collect();
                for &(t, k, shard) in &wanted {
                    let l = local(t, k, shard.device);
                    let global = &mut ebc.tables_mut()[t];
                    let span = (shard.rows, shard.column_range());
                    copy_rows_back(ShardRows::Table(l), global, span, &self.optimizer, made[t])?;
                    if let Some(state) = l.kv_state() {
                        maps[t].push(kv_shard(shard.rows, state));
                    }
                }
            }
            Exec::Rank(comm) => {
                let me = comm.rank();
                let mut w = Writer::new();
                for &(t, k, _) in wanted.iter().filter(|(_, _, s)| s.device == me) {
                    let l = local(t, k, me);
                    w.put(l.row_bytes());
                    w.put(l.optimizer_state());
                    if let Some(state) = l.kv_state() {
                        put_kv(&mut w, &state);
                    }
                }
                let parts = comm.all_gather(w.0)?;
                let mut readers: Vec<Reader> = parts.iter().map(|p| Reader::new(p)).collect();
                for &(t, k, shard) in &wanted {
                    let r = &mut readers[shard.device];
                    let weights: Vec<u8> = r.get().map_err(wire_err)?;
                    let state: Vec<f32> = r.get().map_err(wire_err)?;
                    let config = &self.configs[t];
                    // A key-value shard of buckets has its own fallback row.
                    let fallback = shard.rows.buckets().is_some() as usize;
                    let rows = shard.rows.count(config.num_embeddings) + fallback;
                    let row_bytes = config
                        .data_type
                        .column_range(config.embedding_dim, shard.column_range())
                        .map(|r| r.len());
                    let state_floats = self
                        .optimizer
                        .state_floats_per_row(shard.column_range().len());
                    if row_bytes.map(|b| b * rows) != Some(weights.len())
                        || state.len() != state_floats * rows
                    {
                        return Err(wire_err(format!(
                            "rank {}: shard {k} of table '{}' has {} bytes of rows and {} state floats",
                            shard.device,
                            config.name,
                            weights.len(),
                            state.len()
                        )));
                    }
                    let local = ShardRows::Bytes {
                        rows: &weights,
                        state: &state,
                    };
                    let global = &mut ebc.tables_mut()[t];
                    let span = (shard.rows, shard.column_range());
                    copy_rows_back(local, global, span, &self.optimizer, false)?;
                    if config.kv.is_some() {
                        maps[t].push(kv_shard(shard.rows, get_kv(r)?));
                    }
                }
            }
        }
        // A table sharded by buckets becomes one map, its rows unmoved.
        for (global, shards) in ebc.tables_mut().iter_mut().zip(maps) {
            if !shards.is_empty() {
                global.load_kv_state(merge_shards(&shards))?;
            }
        }
        ebc.set_step(self.step);
        ebc.set_rounding_seed(self.rounding_seed);
        Ok(ebc)
    }
}

/// A shard's map with where it sits in its table.
fn kv_shard(split: RowSplit, state: KvState) -> KvShard {
    let (rows, buckets, _) = split.buckets().unwrap_or((0..0, 0..1, 1));
    KvShard {
        rows: rows.start..rows.start + state.ids.len(),
        buckets,
        state,
    }
}

/// A key-value shard's map on the wire.
fn put_kv(w: &mut Writer, state: &KvState) {
    w.put(&state.ids);
    for part in [&state.last_seen, &state.counts, &state.free, &state.sketch] {
        w.put(part);
    }
    w.put(
        serde_json::to_string(&state.position)
            .expect("plain data")
            .as_bytes(),
    );
}

fn get_kv(r: &mut Reader) -> Result<KvState, ShardingError> {
    let ids = r.get().map_err(wire_err)?;
    let mut part = || r.get::<u32>().map_err(wire_err);
    let (last_seen, counts, free, sketch) = (part()?, part()?, part()?, part()?);
    let position: Vec<u8> = r.get().map_err(wire_err)?;
    let position = serde_json::from_slice(&position).map_err(|e| wire_err(e.to_string()))?;
    Ok(KvState {
        ids,
        last_seen,
        counts,
        free,
        sketch,
        position,
    })
}
