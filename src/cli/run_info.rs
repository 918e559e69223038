//! What a benchmark's `--json` says of the run itself: the command, the
//! machine and the time, so a committed result can be read without its log
//! (the benchmark pages of the book are rendered from such results).

use serde::{Deserialize, Serialize};

/// The run behind a result.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunInfo {
    /// The command line, as typed (arguments joined by spaces).
    pub command: String,
    /// The CPU: its model name, family and model (as `lscpu` shows them),
    /// and whether it has AVX-512.
    pub cpu: String,
    /// Logical CPUs this process may run on.
    pub cpus: usize,
    /// When the run ended, UTC, RFC 3339.
    pub date: String,
    /// Ember's version.
    pub version: String,
}

impl RunInfo {
    /// This process's run, now.
    pub fn now() -> Self {
        // args_os: a path argument need not be UTF-8.
        let mut args = std::env::args_os().map(|a| a.to_string_lossy().into_owned());
        // The program by its name, not the path it was started by.
        let program = args
            .next()
            .map(|p| match std::path::Path::new(&p).file_name() {
                Some(name) => name.to_string_lossy().into_owned(),
                None => p,
            });
        Self {
            command: program
                .into_iter()
                .chain(args)
                .collect::<Vec<_>>()
                .join(" "),
            cpu: cpu_model().unwrap_or_else(|| "unknown".into()),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            date: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            version: env!("CARGO_PKG_VERSION").into(),
        }
    }
}

/// The first CPU of /proc/cpuinfo (Linux; `None` elsewhere).
fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let field = |name: &str| {
        let line = info
            .lines()
            .find(|l| l.split(':').next().map(str::trim) == Some(name))?;
        Some(line.split_once(':')?.1.trim().to_string())
    };
    let avx512 = field("flags").is_some_and(|f| f.split(' ').any(|f| f == "avx512f"));
    Some(format!(
        "{} (family {}, model {}; {})",
        field("model name")?,
        field("cpu family").unwrap_or_default(),
        field("model").unwrap_or_default(),
        if avx512 { "AVX-512" } else { "no AVX-512" }
    ))
}
