//! TensorBoard event files: a run's scalars (loss, AUC, NE, calibration,
//! learning rates, samples/s, per-phase ms) as `tf.Event` records, which
//! TensorBoard and tbparse read, as dlrm_s_pytorch's
//! `--tensor-board-filename` writes them through torch's `SummaryWriter`.
//!
//! A record is TFRecord's framing: the payload's length (u64, little
//! endian), its masked CRC-32C, the payload, the payload's masked CRC-32C.
//! The payload is a `tensorflow.Event` protobuf, encoded by prost from the
//! few fields written (wall_time, step, file_version, summary's tag and
//! simple_value). The framing is written here, not by the `tfrecord`
//! crate, which builds TensorFlow's whole protobuf set for these 4 fields.
//!
//! Records are appended as they come, so TensorBoard shows a live run; each
//! carries its checksums, so a killed run leaves a file whose records up to
//! the last whole one read back (TensorBoard's own writers work the same way).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ember_dataloader::DataError;
use prost::Message;

use crate::{LrSchedule, ModelError, Optimization, PhaseTimes, TrainEvent};

/// `tensorflow.Event`: the fields written.
#[derive(Clone, PartialEq, Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(string, optional, tag = "3")]
    file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value` with a scalar.
#[derive(Clone, PartialEq, Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    /// In a oneof: always written, 0 included (a plain proto3 float of 0
    /// would be left off, and TensorBoard would read no value).
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

/// One event file of scalars.
pub struct EventWriter {
    out: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// A new event file in `dir` (created if missing), named as
    /// TensorFlow's writers name theirs:
    /// `events.out.tfevents.<seconds>.<host>.<pid>`.
    pub fn create(dir: &Path) -> Result<Self, ModelError> {
        std::fs::create_dir_all(dir).map_err(|e| DataError::from_io(dir, e))?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let name = format!(
            "events.out.tfevents.{}.{host}.{}",
            now().as_secs(),
            std::process::id()
        );
        // A new file, never another writer's (two in one second and process).
        let mut path = dir.join(&name);
        let mut n = 0;
        let file = loop {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(file) => break file,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    n += 1;
                    path = dir.join(format!("{name}.{n}"));
                }
                Err(e) => return Err(DataError::from_io(&path, e).into()),
            }
        };
        let mut writer = Self {
            out: BufWriter::new(file),
            path,
        };
        writer.record(&Event {
            wall_time: now().as_secs_f64(),
            step: 0,
            file_version: Some("brain.Event:2".into()),
            summary: None,
        })?;
        Ok(writer)
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Scalars at `step`, one record (NaN values are left out: TensorBoard
    /// draws nothing for them).
    pub fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> Result<(), ModelError> {
        let value: Vec<SummaryValue> = (values.iter())
            .filter(|(_, v)| v.is_finite())
            .map(|&(tag, v)| SummaryValue {
                tag: tag.to_string(),
                simple_value: Some(v as f32),
            })
            .collect();
        if value.is_empty() {
            return Ok(());
        }
        self.record(&Event {
            wall_time: now().as_secs_f64(),
            step: step as i64,
            file_version: None,
            summary: Some(Summary { value }),
        })
    }

    /// Makes what was written readable now.
    pub fn flush(&mut self) -> Result<(), ModelError> {
        let path = &self.path;
        self.out
            .flush()
            .map_err(|e| DataError::from_io(path, e).into())
    }

    fn record(&mut self, event: &Event) -> Result<(), ModelError> {
        let payload = event.encode_to_vec();
        let length = (payload.len() as u64).to_le_bytes();
        let mut bytes = Vec::with_capacity(payload.len() + 16);
        bytes.extend_from_slice(&length);
        bytes.extend_from_slice(&masked_crc(&length).to_le_bytes());
        bytes.extend_from_slice(&payload);
        bytes.extend_from_slice(&masked_crc(&payload).to_le_bytes());
        let path = &self.path;
        (self.out.write_all(&bytes)).map_err(|e| DataError::from_io(path, e).into())
    }
}

/// TFRecord's masked CRC-32C: rotated right by 15 bits, plus a constant.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn now() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

/// A run's [`TrainEvent`]s as TensorBoard scalars: at each log, the mean
/// loss (`train/loss`), samples per second (`train/samples_per_s`), each
/// phase's mean ms per step (`phase_ms/*`) and, when the base rates are
/// known, the learning rates the schedules give (`lr/sparse`, `lr/dense`);
/// at each evaluation `eval/auc`, `eval/logloss`, `eval/ne`,
/// `eval/calibration`, `eval/accuracy`.
pub struct TensorBoardLog {
    writer: EventWriter,
    /// The tables' and dense layers' base rates, and their schedules.
    rates: Option<((f32, f32), Optimization)>,
    /// Since the last log: samples, seconds of steps, and phase sums.
    samples: u64,
    seconds: f64,
    phases: PhaseTimes,
    steps: u32,
}

impl TensorBoardLog {
    /// A log into a new event file in `dir`; `rates`: the optimizers' base
    /// rates (tables, dense) and the run's schedules, to log the rates.
    pub fn create(
        dir: &Path,
        rates: Option<((f32, f32), Optimization)>,
    ) -> Result<Self, ModelError> {
        Ok(Self {
            writer: EventWriter::create(dir)?,
            rates,
            samples: 0,
            seconds: 0.0,
            phases: PhaseTimes::default(),
            steps: 0,
        })
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        self.writer.path()
    }

    /// Takes one event; writes at logs and evaluations (and flushes there).
    pub fn on_event(&mut self, event: &TrainEvent) -> Result<(), ModelError> {
        match event {
            TrainEvent::Step {
                samples,
                times,
                data_wait,
                compute,
                ..
            } => {
                self.samples += *samples as u64;
                self.seconds += (*data_wait + *compute).as_secs_f64();
                self.phases += *times;
                self.steps += 1;
            }
            &TrainEvent::Log { steps, loss, .. } => {
                let n = self.steps.max(1);
                let ms = |d: Duration| d.as_secs_f64() * 1e3 / n as f64;
                let p = self.phases;
                let mut values = vec![
                    ("train/loss", loss),
                    ("train/samples_per_s", self.samples as f64 / self.seconds),
                    ("phase_ms/sparse_forward", ms(p.sparse_forward)),
                    ("phase_ms/dense_forward", ms(p.dense_forward)),
                    ("phase_ms/dense_backward", ms(p.dense_backward)),
                    ("phase_ms/dense_update", ms(p.dense_update)),
                    (
                        "phase_ms/sparse_backward_update",
                        ms(p.sparse_backward_update),
                    ),
                ];
                if let Some(((sparse, dense), o)) = self.rates {
                    // The rate of the last step logged (taken after steps - 1).
                    let at = |s: &LrSchedule, base: f32| s.rate(base, steps.saturating_sub(1));
                    values.push(("lr/sparse", at(&o.sparse_schedule, sparse) as f64));
                    values.push(("lr/dense", at(&o.dense_schedule, dense) as f64));
                }
                self.writer.scalars(steps, &values)?;
                self.writer.flush()?;
                (self.samples, self.seconds, self.steps) = (0, 0.0, 0);
                self.phases = PhaseTimes::default();
            }
            &TrainEvent::Eval { steps, metrics, .. } => {
                let values = [
                    ("eval/auc", metrics.auc),
                    ("eval/logloss", metrics.logloss),
                    ("eval/ne", metrics.ne),
                    ("eval/calibration", metrics.calibration),
                    ("eval/accuracy", metrics.accuracy),
                ];
                self.writer.scalars(steps, &values)?;
                self.writer.flush()?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Flushes what is left.
    pub fn finish(mut self) -> Result<PathBuf, ModelError> {
        self.writer.flush()?;
        Ok(self.writer.path().to_path_buf())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TFRecord's masked CRC of known bytes: CRC-32C("123456789") is
    /// 0xe3069283 (its check value); masked: rotated right 15, plus
    /// 0xa282ead8.
    #[test]
    fn masked_crc_of_the_check_string() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        let want = 0xe306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8);
        assert_eq!(masked_crc(b"123456789"), want);
    }
}
