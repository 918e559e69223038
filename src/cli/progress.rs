//! Progress reporting: a bar on a terminal, plain lines otherwise.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

/// Prints progress lines (to stderr when stdout carries JSON) and, on a
/// terminal, keeps a progress bar below them.
pub struct Progress {
    bar: Option<ProgressBar>,
    to_stderr: bool,
    /// Prints nothing (ranks other than 0).
    quiet: bool,
}

impl Progress {
    pub fn new(total: u64, what: &str, json: bool) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(total);
            bar.set_style(
                ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} {elapsed} (eta {eta})")
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
            );
            bar.set_message(what.to_string());
            bar
        });
        Self {
            bar,
            to_stderr: json,
            quiet: false,
        }
    }

    /// When `quiet`, no bar and no lines.
    pub fn quiet(mut self, quiet: bool) -> Self {
        if quiet {
            self.bar = None;
            self.quiet = true;
        }
        self
    }

    /// A bar counting bytes.
    pub fn bytes(total: u64, what: &str, json: bool) -> Self {
        let p = Self::new(total, what, json);
        if let Some(bar) = &p.bar {
            bar.set_style(
                ProgressStyle::with_template(
                    "{msg} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} (eta {eta})",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
        }
        p
    }

    pub fn set_total(&self, total: u64) {
        if let Some(bar) = &self.bar {
            bar.set_length(total);
        }
    }

    pub fn set(&self, pos: u64) {
        if let Some(bar) = &self.bar {
            bar.set_position(pos);
        }
    }

    pub fn line(&self, text: &str) {
        if self.quiet {
            return;
        }
        match (&self.bar, self.to_stderr) {
            (Some(bar), false) => bar.suspend(|| println!("{text}")),
            (Some(bar), true) => bar.println(text),
            (None, false) => println!("{text}"),
            (None, true) => eprintln!("{text}"),
        }
    }

    pub fn inc(&self) {
        if let Some(bar) = &self.bar {
            bar.inc(1);
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// The process's peak resident set size, in bytes.
pub fn peak_rss_bytes() -> u64 {
    // SAFETY: getrusage writes into the struct we pass.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `usage` is a valid rusage for getrusage to fill.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return 0;
    }
    // ru_maxrss is in KiB on Linux.
    usage.ru_maxrss as u64 * 1024
}
