//! Fault injection: `kill -9` at random moments of `train` (tables in RAM
//! and on the disk tier), `ingest` and `quantize`, then resume or rerun.
//! Every checkpoint left must load, a resumed run must end bitwise where
//! the uninterrupted one did, and nothing may be left behind but what the
//! user asked for. The kill moments are drawn from a seed
//! (`EMBER_FAULT_SEED`, printed on failure) over each command's own
//! measured duration, so the test is reproducible and bounded in time.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{ember, json, names, s, synthetic, tensors, ARCH};
use ember::models::Checkpoint;

/// splitmix64: the kill moments' generator.
struct Moments(u64);

impl Moments {
    /// `EMBER_FAULT_SEED`'s seed, or `default`.
    fn from_env(default: u64) -> Self {
        let seed = std::env::var("EMBER_FAULT_SEED")
            .ok()
            .and_then(|s| s.parse().ok());
        Self(seed.unwrap_or(default))
    }

    /// A moment within `0..=span`.
    fn next(&mut self, span: Duration) -> Duration {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        span.mul_f64((z >> 11) as f64 / (1u64 << 53) as f64)
    }
}

fn spawn(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Runs `args`, killing it (`SIGKILL`) after `after` unless it ended first;
/// whether it was killed.
fn kill_after(args: &[&str], after: Duration) -> bool {
    let mut child = spawn(args);
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return false;
        }
        if start.elapsed() >= after {
            child.kill().unwrap();
            child.wait().unwrap();
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// How long `args` takes, run to its end (which must succeed).
fn timed(args: &[&str]) -> Duration {
    let start = Instant::now();
    ember(args);
    start.elapsed()
}

/// Trains to the end through `kills` runs killed at random moments, each
/// resuming where the last checkpoint stood; then compares the result with
/// an uninterrupted run's and checks the directories hold only the
/// checkpoint.
fn train_through_kills(moments: &mut Moments, extra: &[&str], kills: usize) {
    let dir = tempfile::tempdir().unwrap();
    let data = synthetic(dir.path(), "train", "8000", "0");
    let run = |ckpt: &Path| {
        let mut args = vec![
            "train",
            "--data",
            &data,
            "--epochs",
            "2",
            "--checkpoint-every",
            "10",
        ];
        args.extend_from_slice(&["--checkpoint-dir", s(ckpt), "--resume"]);
        // The extra flags' table sizes, when they give some, for ARCH's.
        let sized = extra.contains(&"--arch-embedding-size");
        let arch = ARCH
            .chunks(2)
            .filter(|f| !(sized && f[0] == "--arch-embedding-size"));
        args.extend(arch.flatten());
        args.extend_from_slice(extra);
        args.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let whole = dir.path().join("whole");
    let args = run(&whole);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let span = timed(&args).mul_f64(1.2);
    let want = tensors(&whole.join("model.safetensors"));

    let ckpt = dir.path().join("killed");
    let args = run(&ckpt);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut killed = 0;
    for k in 0..kills {
        let at = moments.next(span);
        match kill_after(&args, at) {
            true => killed += 1,
            // It ended first: start over, so that later moments hit a run.
            false => std::fs::remove_dir_all(&ckpt).unwrap(),
        }
        // Whatever the kill left loads, or is not there yet.
        if let Some(path) = ember::models::checkpoint::latest(&ckpt, None).unwrap() {
            let opened = Checkpoint::open(&path);
            assert!(opened.is_ok(), "kill {k} at {at:?}: {:?}", opened.err());
        }
    }
    assert!(
        killed > 0,
        "no run was killed: the moments missed every run"
    );
    let last = json(&[&args[..], &["--json"]].concat());
    assert_eq!(last["steps"], 126, "{last}");
    assert_eq!(
        tensors(&ckpt.join("model.safetensors")),
        want,
        "resumed through {kills} kills"
    );
    assert_eq!(names(&ckpt), ["model.safetensors"]);
    if let Some(i) = extra.iter().position(|a| *a == "--disk-dir") {
        assert_eq!(names(Path::new(extra[i + 1])), Vec::<String>::new());
    }
}

/// Seed 7 killed an ingest's rewrite while it removed the old set's parts
/// before its marker: the marker then vouched for a third of a set.
#[test]
fn kill_9_at_random_moments_leaves_nothing_wrong() {
    kills_from(7);
}

#[test]
fn kill_9_at_other_random_moments_leaves_nothing_wrong() {
    kills_from(0x5eed);
}

fn kills_from(default_seed: u64) {
    let mut moments = Moments::from_env(default_seed);
    let seed = moments.0;
    println!("EMBER_FAULT_SEED={seed}");
    train_through_kills(&mut moments, &[], 6);

    // Tables on the disk tier: their files go with each killed run and
    // are reclaimed by the next.
    let disk = tempfile::tempdir().unwrap();
    let big = ["20000"; 26].join("-");
    let extra = ["--disk-dir", s(disk.path()), "--arch-embedding-size", &big];
    train_through_kills(&mut moments, &extra, 4);

    // ingest synthetic: a rerun killed at any moment leaves the old set or
    // the new one whole, never a mix; a rerun to the end leaves the set alone.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let ingest = |rows: &str, seed: &str| {
        let args = [
            "ingest",
            "synthetic",
            "--output",
            s(&out),
            "--rows",
            rows,
            "--seed",
            seed,
        ];
        let mut args: Vec<String> = args.map(String::from).to_vec();
        args.extend(["--row-group-size", "1000", "--rows-per-file", "5000"].map(String::from));
        args
    };
    let first = ingest("3000", "1");
    ember(&first.iter().map(String::as_str).collect::<Vec<_>>());
    let second = ingest("40000", "2");
    let second: Vec<&str> = second.iter().map(String::as_str).collect();
    let span = timed(&second).mul_f64(1.2);
    let mut killed = 0;
    for k in 0..4 {
        let at = moments.next(span);
        killed += kill_after(&second, at) as usize;
        let read = Command::new(env!("CARGO_BIN_EXE_ember"))
            .args([
                "bench",
                "loader",
                "--data",
                s(&out),
                "--mini-batch-size",
                "1000",
                "--json",
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&read.stdout);
        let err = String::from_utf8_lossy(&read.stderr);
        if read.status.success() {
            let rows =
                serde_json::from_str::<serde_json::Value>(text.trim()).unwrap()["rows"].clone();
            assert!(
                rows == 3000 || rows == 40000,
                "kill {k} at {at:?} (seed {seed}): {rows} rows"
            );
        } else {
            assert!(
                err.contains("never finished"),
                "kill {k} at {at:?} (seed {seed}): {err}"
            );
        }
    }
    assert!(killed > 0, "no ingest was killed (seed {seed})");
    ember(&second);
    let parts: Vec<String> = (0..8)
        .map(|n| format!("synthetic-{n:05}.parquet"))
        .collect();
    let want: Vec<String> = std::iter::once("_synthetic.ingest.json".to_string())
        .chain(parts)
        .collect();
    assert_eq!(names(&out), want, "seed {seed}");

    // quantize: killed at any moment, then rerun: the one file asked for.
    let ckpt = dir.path().join("ckpt");
    let data = synthetic(dir.path(), "train", "2000", "0");
    ember(
        &[
            &["train", "--data", &data, "--checkpoint-dir", s(&ckpt)][..],
            ARCH,
        ]
        .concat(),
    );
    let served = dir.path().join("served");
    std::fs::create_dir(&served).unwrap();
    let output = served.join("int8.safetensors");
    let quantize = [
        "quantize",
        "--checkpoint",
        s(&ckpt),
        "--dtype",
        "int8",
        "--output",
        s(&output),
    ];
    let span = timed(&quantize).mul_f64(1.2);
    std::fs::remove_file(&output).unwrap();
    let mut killed = 0;
    for k in 0..4 {
        let at = moments.next(span);
        killed += kill_after(&quantize, at) as usize;
        if output.exists() {
            let opened = Checkpoint::open(&output);
            assert!(
                opened.is_ok(),
                "kill {k} at {at:?} (seed {seed}): {:?}",
                opened.err()
            );
        }
    }
    assert!(killed > 0, "no quantize was killed (seed {seed})");
    ember(&quantize);
    assert_eq!(names(&served), ["int8.safetensors"], "seed {seed}");
    assert_eq!(names(&ckpt), ["model.safetensors"], "seed {seed}");
}
