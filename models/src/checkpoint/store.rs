//! Where a checkpoint's tensors are: the [`TensorStore`] trait and its
//! implementations, one mapped file, a set of mapped files with its index,
//! and safetensors bytes in memory.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ember_sharding::RowSplit;
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, TensorView};
use safetensors::SafeTensors;

use super::set::{self, Index};
use super::write::{fail_at, metadata_crc, METADATA_SUM};
use super::META_CRC32;
use crate::ModelError;

/// The CRC-32 of each tensor of one file, from its metadata; empty for a
/// file written without them (by TorchRec, or an earlier Ember).
#[derive(Default)]
pub(crate) struct Checksums(HashMap<String, u32>);

impl Checksums {
    /// The checksums in `header`'s metadata (of the file at `path`). A
    /// corrupted name must not pass for a file without checksums, or for
    /// one whose metadata is not checksummed: the checksums under another
    /// key, or without the metadata's own, are an error.
    pub(super) fn of(header: &Metadata, path: &Path) -> Result<Self, ModelError> {
        let empty = HashMap::new();
        let metadata = header.metadata().as_ref().unwrap_or(&empty);
        let Some(text) = metadata.get(META_CRC32) else {
            // Ember's checksums are a JSON object that holds the metadata's
            // own under this name; no other writer's metadata does.
            let quoted = format!("\"{METADATA_SUM}\"");
            if let Some(key) = metadata
                .iter()
                .find_map(|(k, v)| v.contains(&quoted).then_some(k))
            {
                return Err(fail_at(
                    path,
                    format!(
                        "metadata '{key}' holds checksums, which belong under \
                         {META_CRC32}: the file is corrupt"
                    ),
                ));
            }
            return Ok(Self::default());
        };
        let bad = |m: String| fail_at(path, format!("metadata {META_CRC32}: {m}"));
        let hex: HashMap<String, String> =
            serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        if !hex.contains_key(METADATA_SUM) {
            return Err(bad(format!(
                "no checksum of the metadata ({METADATA_SUM}) among them: the file is corrupt \
                 (or written before Ember checked its metadata)"
            )));
        }
        let sums = (hex.into_iter())
            .map(|(name, h)| match u32::from_str_radix(&h, 16) {
                Ok(v) if h.len() == 8 => Ok((name, v)),
                _ => Err(bad(format!("'{h}' (of {name}) is not 8 hex digits"))),
            })
            .collect::<Result<HashMap<String, u32>, _>>()?;
        if let Some(&want) = sums.get(METADATA_SUM) {
            let got = metadata_crc(metadata);
            if got != want {
                return Err(fail_at(
                    path,
                    format!(
                        "the metadata (architecture, optimizers, steps) do not match the \
                         checksum written with them (crc32 {got:08x}, expected {want:08x}): \
                         the file is corrupt"
                    ),
                ));
            }
        }
        Ok(Self(sums))
    }

    /// [`verify`](Self::verify) with the bytes' CRC-32 already summed.
    fn verify_sum(&self, name: &str, got: u32) -> Result<(), String> {
        match self.0.get(name) {
            Some(&want) if got != want => Err(format!(
                "its bytes do not match the checksum written with them (crc32 {got:08x}, \
                 expected {want:08x}): the file is corrupt"
            )),
            None if !self.0.is_empty() => Err(format!(
                "the file's checksums ({META_CRC32}) have none for it: the file is corrupt"
            )),
            _ => Ok(()),
        }
    }

    /// Whether tensor `name`'s bytes are the ones written (always, in a
    /// file without checksums; in a file with them, a tensor without one
    /// has had its name in the checksums corrupted).
    fn verify(&self, name: &str, bytes: &[u8]) -> Result<(), String> {
        self.verify_sum(name, crc32fast::hash(bytes))
    }
}

/// What a streamed read does with each piece of rows: `(first row, each
/// tensor's bytes of those rows)`.
pub(crate) type PieceReader<'a> = dyn FnMut(usize, &[&[u8]]) -> Result<(), ModelError> + 'a;

/// A checkpoint's tensors, read by name: each read checks the tensor's
/// presence, dtype and shape first. Errors name the tensor and the file at
/// fault. Tensors are `[rows]` or `[rows, columns]` of one dtype.
pub(crate) trait TensorStore: Send + Sync {
    /// What errors name for the checkpoint as a whole: the file, a set's
    /// index, or the name in-memory bytes were given.
    fn path(&self) -> &Path;

    /// The checkpoint's metadata (for a set: the index's).
    fn metadata(&self) -> &HashMap<String, String>;

    /// Every file it reads (a set: its index and each rank's file).
    fn files(&self) -> Vec<PathBuf> {
        vec![self.path().to_path_buf()]
    }

    /// The name and shape of every tensor, where one header lists them all
    /// (one file or its bytes; `None` for a set).
    fn shapes(&self) -> Option<&BTreeMap<String, Vec<usize>>>;

    /// `read` applied once to the named tensor's bytes after the checks (a
    /// tensor split into pieces is put together first); not called on an
    /// error.
    fn view(
        &self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        read: &mut dyn FnMut(&[u8]),
    ) -> Result<(), ModelError>;

    /// Checks the named tensor's presence, dtype and shape without reading
    /// its data (for a split tensor: each piece's, and that they add up).
    fn check(&self, name: &str, dtype: Dtype, shape: &[usize]) -> Result<(), ModelError> {
        self.view(name, dtype, shape, &mut |_| ())
    }

    /// The named tensor where it lies in the store's one mapped file (its
    /// presence, dtype and shape checked, not its bytes), to be read in
    /// place; `None` for a store of another kind (bytes in memory, a set).
    fn in_place(
        &self,
        _name: &str,
        _dtype: Dtype,
        _shape: &[usize],
    ) -> Result<Option<InPlace>, ModelError> {
        Ok(None)
    }

    /// The bytes of rows `rows` and columns `cols` of the named tensor of
    /// `dtype` and `shape` (`[rows, cols]`, or `[rows]` read as one
    /// column), in local row order.
    fn rows_bytes(
        &self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        rows: RowSplit,
        cols: Range<usize>,
    ) -> Result<Vec<u8>, ModelError> {
        let mut out = Vec::new();
        self.view(name, dtype, shape, &mut |bytes| {
            out = select(bytes, element_bytes(dtype), shape, rows, cols.clone())
        })?;
        Ok(out)
    }

    /// `read(first_row, pieces)` over rows of `tensors` (each a name,
    /// dtype and shape of the same number of rows) in order, `piece_rows`
    /// rows of each at a time, after the checks of `view`: how a table
    /// larger than memory is loaded, its weight and optimizer state
    /// together. Checksums are verified at the end, so a corrupt tensor
    /// fails after its pieces were read.
    fn stream_rows(
        &self,
        tensors: &[(&str, Dtype, &[usize])],
        piece_rows: usize,
        read: &mut PieceReader<'_>,
    ) -> Result<(), ModelError>;

    /// [`rows_bytes`](Self::rows_bytes) of an F32 tensor, as values.
    fn rows_of(
        &self,
        name: &str,
        shape: &[usize],
        rows: RowSplit,
        cols: Range<usize>,
    ) -> Result<Vec<f32>, ModelError> {
        Ok(f32s(&self.rows_bytes(
            name,
            Dtype::F32,
            shape,
            rows,
            cols,
        )?))
    }
}

/// One safetensors file's bytes: mapped ([`MappedFile`]) or in memory
/// ([`InMemory`]).
pub(crate) struct OneFile<B> {
    path: PathBuf,
    bytes: B,
    metadata: HashMap<String, String>,
    checksums: Checksums,
    shapes: BTreeMap<String, Vec<usize>>,
}

/// One safetensors file, memory-mapped.
pub(crate) type MappedFile = OneFile<SharedMap>;

/// A file's mapping, which tables that read their rows in place share.
pub(crate) struct SharedMap(Arc<Mmap>);

impl AsRef<[u8]> for SharedMap {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Release for SharedMap {
    fn release(&self, range: Range<usize>) {
        self.0.release(range)
    }

    fn mapping(&self) -> Option<&Arc<Mmap>> {
        Some(&self.0)
    }
}

/// A tensor's bytes where they lie in a mapped file: the mapping, and the
/// range of the tensor in it.
pub(crate) type InPlace = (Arc<Mmap>, Range<usize>);

/// A safetensors file's bytes in memory, named by `path` in errors.
pub(crate) type InMemory = OneFile<Vec<u8>>;

impl MappedFile {
    /// Maps `path` and reads its header.
    pub(crate) fn open(path: &Path) -> Result<Self, ModelError> {
        OneFile::new(SharedMap(Arc::new(map(path)?)), path)
    }
}

impl<B: AsRef<[u8]>> OneFile<B> {
    /// `bytes` (named `path` in errors), their header read and checked.
    pub(crate) fn new(bytes: B, path: &Path) -> Result<Self, ModelError> {
        let (_, header) = SafeTensors::read_metadata(bytes.as_ref())
            .map_err(|e| fail_at(path, format!("not a safetensors file: {e}")))?;
        let metadata = header.metadata().clone().unwrap_or_default();
        let shapes = (header.tensors().into_iter())
            .map(|(name, info)| (name, info.shape.clone()))
            .collect();
        Ok(Self {
            path: path.to_path_buf(),
            bytes,
            checksums: Checksums::of(&header, path)?,
            metadata,
            shapes,
        })
    }
}

impl<B: AsRef<[u8]> + Release + Send + Sync> TensorStore for OneFile<B> {
    fn path(&self) -> &Path {
        &self.path
    }

    fn metadata(&self) -> &HashMap<String, String> {
        &self.metadata
    }

    fn shapes(&self) -> Option<&BTreeMap<String, Vec<usize>>> {
        Some(&self.shapes)
    }

    fn view(
        &self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        read: &mut dyn FnMut(&[u8]),
    ) -> Result<(), ModelError> {
        let sums = Some(&self.checksums);
        file_view(self.bytes.as_ref(), name, dtype, Some(shape), sums, read)
            .map(|_| ())
            .map_err(|message| fail_on(&self.path, name, message))
    }

    fn check(&self, name: &str, dtype: Dtype, shape: &[usize]) -> Result<(), ModelError> {
        file_view(self.bytes.as_ref(), name, dtype, Some(shape), None, |_| ())
            .map(|_| ())
            .map_err(|message| fail_on(&self.path, name, message))
    }

    fn in_place(
        &self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
    ) -> Result<Option<InPlace>, ModelError> {
        let Some(map) = self.bytes.mapping() else {
            return Ok(None);
        };
        let base = map.as_ptr() as usize;
        let (range, _) = file_view(map, name, dtype, Some(shape), None, |data| {
            let at = data.as_ptr() as usize - base;
            at..at + data.len()
        })
        .map_err(|message| fail_on(&self.path, name, message))?;
        Ok(Some((Arc::clone(map), range)))
    }

    /// Pieces of the file's bytes, each let go of once read (a mapped
    /// file's pages then leave the process), the checksums summed on the way.
    fn stream_rows(
        &self,
        tensors: &[(&str, Dtype, &[usize])],
        piece_rows: usize,
        read: &mut PieceReader<'_>,
    ) -> Result<(), ModelError> {
        let all = self.bytes.as_ref();
        let file = SafeTensors::deserialize(all).map_err(|e| fail_at(&self.path, e.to_string()))?;
        let views = (tensors.iter())
            .map(|&(name, dtype, shape)| {
                let fail = |message: String| fail_on(&self.path, name, message);
                let view = file.tensor(name).map_err(|_| fail("missing".into()))?;
                if view.dtype() != dtype || view.shape() != shape {
                    return Err(fail(format!(
                        "{:?} of shape {:?}, expected {dtype:?} of {shape:?}",
                        view.dtype(),
                        view.shape()
                    )));
                }
                Ok(view.data())
            })
            .collect::<Result<Vec<&[u8]>, _>>()?;
        let mut sums = vec![crc32fast::Hasher::new(); tensors.len()];
        in_pieces(&views, tensors, piece_rows, read, |t, piece| {
            sums[t].update(piece);
            let at = piece.as_ptr() as usize - all.as_ptr() as usize;
            self.bytes.release(at..at + piece.len());
        })?;
        for ((name, _, _), sum) in tensors.iter().zip(sums) {
            (self.checksums.verify_sum(name, sum.finalize()))
                .map_err(|message| fail_on(&self.path, name, message))?;
        }
        Ok(())
    }
}

/// Bytes a store can let go of once read.
pub(crate) trait Release {
    /// `range` of the bytes will not be read again soon.
    fn release(&self, range: Range<usize>);

    /// The file mapping they are, to share (`None`: bytes in memory).
    fn mapping(&self) -> Option<&Arc<Mmap>> {
        None
    }
}

impl Release for Mmap {
    fn release(&self, range: Range<usize>) {
        // SAFETY: a read-only file mapping: pages dropped are read from the
        // file again if touched, so no value the process sees changes.
        let _ = unsafe {
            self.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                range.start,
                range.len(),
            )
        };
    }
}

impl Release for Vec<u8> {
    fn release(&self, _: Range<usize>) {}
}

/// `read(first_row, pieces)` over `bytes` (of `tensors`, their shapes of
/// the same rows) in pieces of `piece_rows` rows, `done(tensor, piece)`
/// after each.
fn in_pieces(
    bytes: &[&[u8]],
    tensors: &[(&str, Dtype, &[usize])],
    piece_rows: usize,
    read: &mut PieceReader<'_>,
    mut done: impl FnMut(usize, &[u8]),
) -> Result<(), ModelError> {
    let rows = tensors
        .first()
        .map_or(0, |t| t.2.first().copied().unwrap_or(0));
    let piece_rows = piece_rows.max(1);
    let row_bytes: Vec<usize> = bytes.iter().map(|b| b.len() / rows.max(1)).collect();
    for first in (0..rows).step_by(piece_rows) {
        let n = piece_rows.min(rows - first);
        let pieces: Vec<&[u8]> = (bytes.iter().zip(&row_bytes))
            .map(|(b, &r)| &b[first * r..(first + n) * r])
            .collect();
        read(first, &pieces)?;
        for (t, piece) in pieces.iter().enumerate() {
            done(t, piece);
        }
    }
    Ok(())
}

/// A set: its index and the files it names (by name, in `dir`), mapped.
pub(crate) struct SetStore {
    /// The index's path.
    path: PathBuf,
    dir: PathBuf,
    index: Index,
    files: HashMap<String, Mmap>,
    checksums: HashMap<String, Checksums>,
}

impl SetStore {
    /// Reads the index at `index_path` and maps every file it names.
    pub(crate) fn open(index_path: &Path) -> Result<Self, ModelError> {
        let index = set::read_index(index_path)?;
        let dir = index_path.parent().unwrap_or(Path::new(".")).to_path_buf();
        let (mut files, mut checksums) = (HashMap::new(), HashMap::new());
        let names =
            (index.weight_map.values()).chain(index.pieces.values().flatten().map(|p| &p.file));
        for name in names {
            if !files.contains_key(name) {
                let path = dir.join(name);
                let bytes = map(&path)?;
                let (_, header) = SafeTensors::read_metadata(&bytes)
                    .map_err(|e| fail_at(&path, format!("not a safetensors file: {e}")))?;
                checksums.insert(name.clone(), Checksums::of(&header, &path)?);
                files.insert(name.clone(), bytes);
            }
        }
        Ok(Self {
            path: index_path.to_path_buf(),
            dir,
            index,
            files,
            checksums,
        })
    }
}

/// One file's part of a tensor being streamed from a set: which of the
/// tensor's rows and columns it holds, its bytes, and its checksum so far.
struct Part<'a> {
    file: &'a str,
    tensor: &'a str,
    rows: RowSplit,
    cols: Range<usize>,
    data: &'a [u8],
    sum: crc32fast::Hasher,
}

impl SetStore {
    /// The parts of tensor `name` (`dtype`, `shape`): the file holding it
    /// whole, or each of its pieces, checked for dtype and shape.
    fn parts<'a>(
        &'a self,
        name: &'a str,
        dtype: Dtype,
        shape: &[usize],
    ) -> Result<Vec<Part<'a>>, ModelError> {
        let (rows, width) = (shape[0], shape.get(1).copied().unwrap_or(1));
        let whole = self.index.weight_map.get_key_value(name).map(|(_, file)| {
            let all = (RowSplit::All, 0..width, name);
            vec![(file.as_str(), all)]
        });
        let pieces = || {
            (self.index.pieces.get(name).into_iter().flatten())
                .map(|p| {
                    let cols = match shape.len() {
                        1 => 0..1,
                        _ => p.columns[0]..p.columns[1],
                    };
                    (p.file.as_str(), (p.rows, cols, p.tensor.as_str()))
                })
                .collect::<Vec<_>>()
        };
        let listed = whole.unwrap_or_else(pieces);
        if listed.is_empty() {
            return Err(fail_on(&self.path, name, "missing".into()));
        }
        listed
            .into_iter()
            .map(|(file, (split, cols, tensor))| {
                let fail = |m: String| fail_on(&self.dir.join(file), tensor, m);
                let bytes = self.files.get(file).ok_or_else(|| fail("not mapped".into()))?;
                let st = SafeTensors::deserialize(bytes).map_err(|e| fail(e.to_string()))?;
                let view = st.tensor(tensor).map_err(|_| fail("missing".into()))?;
                let want: Vec<usize> = match shape.len() {
                    1 => vec![split.count(rows)],
                    _ => vec![split.count(rows), cols.len()],
                };
                if view.dtype() != dtype || view.shape() != want || cols.end > width {
                    return Err(fail(format!(
                        "{:?} of shape {:?}, expected {dtype:?} of {want:?} (columns {cols:?} of {width})",
                        view.dtype(),
                        view.shape()
                    )));
                }
                Ok(Part {
                    file,
                    tensor,
                    rows: split,
                    cols,
                    data: view.data(),
                    sum: crc32fast::Hasher::new(),
                })
            })
            .collect()
    }
}

impl TensorStore for SetStore {
    fn path(&self) -> &Path {
        &self.path
    }

    fn files(&self) -> Vec<PathBuf> {
        let parts = self.files.keys().map(|f| self.dir.join(f));
        std::iter::once(self.path.clone()).chain(parts).collect()
    }

    /// Each piece of rows put together from the files' parts (a part's
    /// rows are visited in order, so its checksum sums on the way), and
    /// each part's pages let go of once read.
    fn stream_rows(
        &self,
        tensors: &[(&str, Dtype, &[usize])],
        piece_rows: usize,
        read: &mut PieceReader<'_>,
    ) -> Result<(), ModelError> {
        let mut parts = (tensors.iter())
            .map(|&(name, dtype, shape)| self.parts(name, dtype, shape))
            .collect::<Result<Vec<_>, _>>()?;
        let rows = tensors
            .first()
            .map_or(0, |t| t.2.first().copied().unwrap_or(0));
        let widths: Vec<(usize, usize)> = (tensors.iter())
            .map(|&(_, dtype, shape)| (shape.get(1).copied().unwrap_or(1), element_bytes(dtype)))
            .collect();
        let piece_rows = piece_rows.max(1);
        let mut buffers: Vec<Vec<u8>> = vec![Vec::new(); tensors.len()];
        let mut covered = vec![0usize; tensors.len()];
        for first in (0..rows).step_by(piece_rows) {
            let n = piece_rows.min(rows - first);
            for (t, buf) in buffers.iter_mut().enumerate() {
                let (width, size) = widths[t];
                buf.clear();
                buf.resize(n * width * size, 0);
                for part in &mut parts[t] {
                    let row = part.cols.len() * size;
                    let (mut lo, mut hi) = (usize::MAX, 0);
                    for g in first..first + n {
                        let Some(l) = part.rows.local(g) else {
                            continue;
                        };
                        let src = &part.data[l * row..(l + 1) * row];
                        part.sum.update(src);
                        let at = ((g - first) * width + part.cols.start) * size;
                        buf[at..at + row].copy_from_slice(src);
                        covered[t] += part.cols.len();
                        (lo, hi) = (lo.min(l), hi.max(l + 1));
                    }
                    if lo < hi {
                        let base =
                            part.data.as_ptr() as usize - self.files[part.file].as_ptr() as usize;
                        self.files[part.file].release(base + lo * row..base + hi * row);
                    }
                }
            }
            let pieces: Vec<&[u8]> = buffers.iter().map(Vec::as_slice).collect();
            read(first, &pieces)?;
        }
        for ((t, &(name, _, _)), parts) in tensors.iter().enumerate().zip(parts) {
            if covered[t] != rows * widths[t].0 {
                return Err(fail_on(
                    &self.path,
                    name,
                    format!(
                        "the pieces cover {} of its {} values",
                        covered[t],
                        rows * widths[t].0
                    ),
                ));
            }
            for part in parts {
                let sums = self.checksums.get(part.file);
                if let Some(sums) = sums {
                    (sums.verify_sum(part.tensor, part.sum.finalize()))
                        .map_err(|m| fail_on(&self.dir.join(part.file), part.tensor, m))?;
                }
            }
        }
        Ok(())
    }

    fn metadata(&self) -> &HashMap<String, String> {
        &self.index.metadata
    }

    fn shapes(&self) -> Option<&BTreeMap<String, Vec<usize>>> {
        None
    }

    fn view(
        &self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        read: &mut dyn FnMut(&[u8]),
    ) -> Result<(), ModelError> {
        if let Some(file) = self.index.weight_map.get(name) {
            let sums = self.checksums.get(file);
            return file_view(&self.files[file], name, dtype, Some(shape), sums, read)
                .map(|_| ())
                .map_err(|m| fail_on(&self.dir.join(file), name, m));
        }
        let cols = shape.get(1).copied().unwrap_or(1);
        let bytes = self.rows_bytes(name, dtype, shape, RowSplit::All, 0..cols)?;
        read(&bytes);
        Ok(())
    }

    fn check(&self, name: &str, dtype: Dtype, shape: &[usize]) -> Result<(), ModelError> {
        let Some(pieces) = self.index.pieces.get(name) else {
            // Checked, not read: its checksum is verified when it is read.
            let Some(file) = self.index.weight_map.get(name) else {
                return Err(fail_on(&self.path, name, "missing".into()));
            };
            return file_view(&self.files[file], name, dtype, Some(shape), None, |_| ())
                .map(|_| ())
                .map_err(|m| fail_on(&self.dir.join(file), name, m));
        };
        let fail = |message: String| fail_on(&self.path, name, message);
        let (rows, cols) = (shape[0], shape.get(1).copied().unwrap_or(1));
        let mut values = 0;
        for p in pieces {
            let want: Vec<usize> = match shape.len() {
                1 => vec![p.rows.count(rows)],
                _ => vec![
                    p.rows.count(rows),
                    p.columns[1].saturating_sub(p.columns[0]),
                ],
            };
            file_view(
                &self.files[&p.file],
                &p.tensor,
                dtype,
                Some(&want),
                None,
                |_| (),
            )
            .map_err(|m| fail(format!("{}: {m}", p.file)))?;
            values += want.iter().product::<usize>();
        }
        if values != rows * cols {
            return Err(fail(format!(
                "the pieces hold {values} of {} values",
                rows * cols
            )));
        }
        Ok(())
    }

    fn rows_bytes(
        &self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        rows: RowSplit,
        cols: Range<usize>,
    ) -> Result<Vec<u8>, ModelError> {
        let fail = |message: String| fail_on(&self.path, name, message);
        let size = element_bytes(dtype);
        // A whole tensor in one mapped file.
        if let Some(file) = self.index.weight_map.get(name) {
            let sums = self.checksums.get(file);
            return file_view(&self.files[file], name, dtype, Some(shape), sums, |bytes| {
                select(bytes, size, shape, rows, cols)
            })
            .map(|(v, _)| v)
            .map_err(fail);
        }
        let (total, width) = (shape[0], shape.get(1).copied().unwrap_or(1));
        let (lr, lc) = (rows.count(total), cols.len());
        let mut out = vec![0u8; lr * lc * size];
        let pieces = (self.index.pieces)
            .get(name)
            .ok_or_else(|| fail("missing".into()))?;
        let mut covered = 0;
        for p in pieces {
            let pc = match shape.len() {
                1 => 0..1,
                _ => p.columns[0]..p.columns[1],
            };
            if pc.end > width {
                return Err(fail(format!(
                    "{}: a piece of columns {:?} of {shape:?}",
                    p.file, p.columns
                )));
            }
            let (from, to) = (cols.start.max(pc.start), cols.end.min(pc.end));
            let plr = p.rows.count(total);
            // A piece with none of this shard's values is not read (nor its
            // checksum computed): a rank reads its own shards only.
            let overlaps = from < to && (0..plr).any(|lp| rows.local(p.rows.global(lp)).is_some());
            if !overlaps {
                continue;
            }
            let want: Vec<usize> = match shape.len() {
                1 => vec![plr],
                _ => vec![plr, pc.len()],
            };
            let (n, _) = file_view(
                &self.files[&p.file],
                &p.tensor,
                dtype,
                Some(&want),
                self.checksums.get(&p.file),
                |bytes| {
                    let mut n = 0;
                    for lp in 0..plr {
                        let Some(l) = rows.local(p.rows.global(lp)) else {
                            continue;
                        };
                        if from < to {
                            let src = (lp * pc.len() + from - pc.start) * size;
                            let dst = (l * lc + from - cols.start) * size;
                            let len = (to - from) * size;
                            out[dst..dst + len].copy_from_slice(&bytes[src..src + len]);
                            n += to - from;
                        }
                    }
                    n
                },
            )
            .map_err(|m| fail(format!("{}: {m}", p.file)))?;
            covered += n;
        }
        if covered != lr * lc {
            return Err(fail(format!(
                "the pieces cover {covered} of the {} values of this shard",
                lr * lc
            )));
        }
        Ok(out)
    }
}

/// A checkpoint error about tensor `name` of the file at `path`.
fn fail_on(path: &Path, name: &str, message: String) -> ModelError {
    ModelError::Checkpoint {
        path: path.to_path_buf(),
        tensor: Some(name.to_string()),
        message,
    }
}

/// Maps the file at `path` read-only.
pub(super) fn map(path: &Path) -> Result<Mmap, ModelError> {
    let file = File::open(path).map_err(|e| fail_at(path, e.to_string()))?;
    // SAFETY: the map is read-only; a file changed under a running
    // process is outside what a checkpoint reader can defend against.
    unsafe { Mmap::map(&file) }.map_err(|e| fail_at(path, e.to_string()))
}

/// `read` applied to a tensor of one file's bytes, after checking its dtype,
/// (when given) its shape and (when given) its checksum; with no shape to
/// check, the tensor's shape comes back with the result.
pub(super) fn file_view<R>(
    bytes: &[u8],
    name: &str,
    dtype: Dtype,
    shape: Option<&[usize]>,
    checksums: Option<&Checksums>,
    read: impl FnOnce(&[u8]) -> R,
) -> Result<(R, Vec<usize>), String> {
    let tensors = SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
    let view: TensorView = tensors.tensor(name).map_err(|_| "missing".to_string())?;
    if view.dtype() != dtype {
        return Err(format!("dtype {:?}, expected {dtype:?}", view.dtype()));
    }
    if let Some(shape) = shape {
        if view.shape() != shape {
            return Err(format!("shape {:?}, expected {shape:?}", view.shape()));
        }
    }
    if let Some(sums) = checksums {
        sums.verify(name, view.data())?;
    }
    Ok((read(view.data()), view.shape().to_vec()))
}

/// The bytes of rows `rows` and columns `cols` of a whole tensor's bytes
/// of `shape` (`[rows, cols]`, or `[rows]` read as one column) and
/// `size`-byte elements, in local row order.
fn select(
    bytes: &[u8],
    size: usize,
    shape: &[usize],
    rows: RowSplit,
    cols: Range<usize>,
) -> Vec<u8> {
    let (total, width) = (shape[0], shape.get(1).copied().unwrap_or(1));
    let (lr, lc) = (rows.count(total), cols.len());
    let mut out = vec![0u8; lr * lc * size];
    for (l, row) in out
        .chunks_exact_mut((lc * size).max(1))
        .enumerate()
        .take(lr)
    {
        let at = (rows.global(l) * width + cols.start) * size;
        row.copy_from_slice(&bytes[at..at + lc * size]);
    }
    out
}

/// Bytes per element of `dtype` (the types checkpoints hold are whole bytes).
fn element_bytes(dtype: Dtype) -> usize {
    dtype.bitsize().div_ceil(8)
}

/// Little-endian f32 values.
pub(super) fn f32s(bytes: &[u8]) -> Vec<f32> {
    (bytes.chunks_exact(4))
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}
