//! `PjrtBackend`: the dense ops of [`DenseBackend`] compiled by a PJRT
//! plugin, one executable per (op, shape), cached in memory and run eagerly
//! in program order (the `strict` mode: results come back when the host
//! needs them, which is after every op here since layers hold host tensors).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::cache::{plugin_identity, DiskCache};
use super::hlo::Func;
use super::lower;
use super::runtime::{Client, Executable, COMPILE_OPTIONS};
use crate::backend::{Activation, DenseBackend};
use crate::tensor::Tensor;

/// Counters of the executable caches.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct CompileStats {
    /// Programs compiled by the plugin, and the time it took.
    pub compiles: u64,
    pub compile_ms: f64,
    /// Programs loaded from the on-disk cache instead, and the time it took.
    pub compile_cache_hits: u64,
    pub cache_load_ms: f64,
    pub executions: u64,
}

pub struct PjrtBackend {
    client: Client,
    cache: Mutex<HashMap<String, Arc<Executable>>>,
    disk: Option<DiskCache>,
    stats: Mutex<CompileStats>,
}

impl PjrtBackend {
    /// A backend with an in-memory executable cache only.
    pub fn new(client: Client) -> Self {
        Self {
            client,
            cache: Mutex::new(HashMap::new()),
            disk: None,
            stats: Mutex::new(CompileStats::default()),
        }
    }

    /// Also keeps compiled executables in `dir`, for later processes.
    pub fn with_disk_cache(client: Client, dir: PathBuf) -> Self {
        let mut identity = plugin_identity(client.plugin().path());
        // What else changes the compiled code: the platform's version and XLA's flags.
        identity.extend_from_slice(client.platform_version().unwrap_or_default().as_bytes());
        identity.push(b'|');
        identity.extend(
            std::env::var_os("XLA_FLAGS")
                .unwrap_or_default()
                .as_encoded_bytes(),
        );
        Self {
            disk: Some(DiskCache::new(dir, identity)),
            ..Self::new(client)
        }
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn stats(&self) -> CompileStats {
        *self.stats.lock().expect("stats lock")
    }

    /// The executable of `program`: from memory, the disk cache, or compiled.
    /// A program the plugin rejects is a bug in Ember; see [`Self::try_executable`].
    pub fn executable(&self, program: &str) -> Arc<Executable> {
        self.try_executable(program)
            .unwrap_or_else(|e| panic!("PJRT backend: {e}\nprogram:\n{program}"))
    }

    /// As [`Self::executable`], with the plugin's error (out of memory, a
    /// rejected program) returned.
    pub fn try_executable(&self, program: &str) -> Result<Arc<Executable>, super::PjrtError> {
        if let Some(e) = self.cache.lock().expect("cache lock").get(program) {
            return Ok(e.clone());
        }
        let t = Instant::now();
        // A stored executable that does not load (stale, corrupt) is recompiled.
        let cached = (self.disk.as_ref())
            .and_then(|d| d.get(program, COMPILE_OPTIONS))
            .and_then(|bytes| self.client.deserialize(&bytes).ok());
        let exe = match cached {
            Some(exe) => {
                let mut s = self.stats.lock().expect("stats lock");
                s.compile_cache_hits += 1;
                s.cache_load_ms += t.elapsed().as_secs_f64() * 1e3;
                exe
            }
            None => {
                let exe = self.client.compile(program)?;
                let mut s = self.stats.lock().expect("stats lock");
                s.compiles += 1;
                s.compile_ms += t.elapsed().as_secs_f64() * 1e3;
                drop(s);
                if let (Some(disk), Ok(bytes)) = (&self.disk, exe.serialize()) {
                    disk.put(program, COMPILE_OPTIONS, &bytes);
                }
                exe
            }
        };
        let exe = Arc::new(exe);
        self.cache
            .lock()
            .expect("cache lock")
            .insert(program.to_string(), exe.clone());
        Ok(exe)
    }

    /// Runs `program` on host inputs, returning every output on the host.
    /// A PJRT failure here is a bug in Ember or the plugin: the trait's ops
    /// are infallible, so it panics with the plugin's message.
    fn run(&self, program: &str, inputs: &[(&[f32], &[usize])]) -> Vec<Vec<f32>> {
        let exe = self.executable(program);
        let fail = |e: super::PjrtError| -> ! { panic!("PJRT backend: {e}") };
        let buffers: Vec<_> = inputs
            .iter()
            .map(|(data, dims)| {
                self.client
                    .buffer_f32(data, dims)
                    .unwrap_or_else(|e| fail(e))
            })
            .collect();
        let refs: Vec<_> = buffers.iter().collect();
        let outs = exe.execute(&refs).unwrap_or_else(|e| fail(e));
        self.stats.lock().expect("stats lock").executions += 1;
        outs.iter()
            .map(|b| b.to_f32().unwrap_or_else(|e| fail(e)))
            .collect()
    }
}

fn set(t: &mut Tensor<f32>, rows: usize, cols: usize, data: Vec<f32>) {
    t.resize(rows, cols);
    t.data_mut().copy_from_slice(&data);
}

impl DenseBackend<f32> for PjrtBackend {
    fn name(&self) -> &'static str {
        "pjrt"
    }

    fn matmul(
        &self,
        a: &Tensor<f32>,
        trans_a: bool,
        b: &Tensor<f32>,
        trans_b: bool,
        alpha: f32,
        beta: f32,
        c: &mut Tensor<f32>,
    ) {
        let (ad, bd) = ([a.rows(), a.cols()], [b.rows(), b.cols()]);
        let (m, k) = if trans_a {
            (ad[1], ad[0])
        } else {
            (ad[0], ad[1])
        };
        let (kb, n) = if trans_b {
            (bd[1], bd[0])
        } else {
            (bd[0], bd[1])
        };
        assert_eq!(k, kb, "matmul: inner dims {k} and {kb} differ");
        let mut f = Func::new();
        let (pa, pb) = (f.arg(&ad), f.arg(&bd));
        let (p, dims) = f.dot(
            &pa,
            &ad,
            if trans_a { 0 } else { 1 },
            &pb,
            &bd,
            if trans_b { 1 } else { 0 },
        );
        let mut out = p;
        if alpha != 1.0 {
            let s = f.splat(alpha, &dims);
            out = f.binary("multiply", &out, &s, &dims);
        }
        let mut inputs: Vec<(&[f32], &[usize])> = vec![(a.data(), &ad), (b.data(), &bd)];
        let cd = [m, n];
        if beta != 0.0 {
            assert_eq!(
                c.shape(),
                (m, n),
                "matmul: c must be [{m}, {n}] when beta != 0"
            );
            let pc = f.arg(&cd);
            let s = f.splat(beta, &cd);
            let bc = f.binary("multiply", &pc, &s, &cd);
            out = f.binary("add", &out, &bc, &cd);
            inputs.push((c.data(), &cd));
        }
        let program = f.finish(&[(out, dims)]);
        let r = self.run(&program, &inputs).remove(0);
        set(c, m, n, r);
    }

    fn linear_forward(
        &self,
        x: &Tensor<f32>,
        w: &Tensor<f32>,
        b: &[f32],
        act: Activation,
        y: &mut Tensor<f32>,
    ) {
        let (n, inp, out) = (x.rows(), x.cols(), w.rows());
        assert_eq!(
            w.cols(),
            inp,
            "linear_forward: w is [{out}, {}] for x of {inp} columns",
            w.cols()
        );
        let mut f = Func::new();
        let (px, pw, pb) = (f.arg(&[n, inp]), f.arg(&[out, inp]), f.arg(&[out]));
        let r = lower::linear_forward(&mut f, &px, &pw, &pb, n, inp, out, act);
        let dims = vec![n, out];
        let program = f.finish(&[(r, dims)]);
        let res = self
            .run(
                &program,
                &[(x.data(), &[n, inp]), (w.data(), &[out, inp]), (b, &[out])],
            )
            .remove(0);
        set(y, n, out, res);
    }

    fn linear_backward(
        &self,
        x: &Tensor<f32>,
        w: &Tensor<f32>,
        y: &Tensor<f32>,
        act: Activation,
        dy: &mut Tensor<f32>,
        dw: &mut Tensor<f32>,
        db: &mut [f32],
        dx: Option<&mut Tensor<f32>>,
    ) {
        let (n, inp, out) = (x.rows(), x.cols(), w.rows());
        let mut f = Func::new();
        let (px, pw, py, pdy) = (
            f.arg(&[n, inp]),
            f.arg(&[out, inp]),
            f.arg(&[n, out]),
            f.arg(&[n, out]),
        );
        let no = [n, out];
        let (dz, gw, gb, gx) =
            lower::linear_backward(&mut f, &px, &pw, &py, &pdy, n, inp, out, act, dx.is_some());
        let mut results = vec![(dz, no.to_vec()), (gw, vec![out, inp]), (gb, vec![out])];
        if let Some(gx) = gx {
            results.push((gx, vec![n, inp]));
        }
        let program = f.finish(&results);
        let mut r = self.run(
            &program,
            &[
                (x.data(), &[n, inp]),
                (w.data(), &[out, inp]),
                (y.data(), &no),
                (dy.data(), &no),
            ],
        );
        dy.data_mut().copy_from_slice(&r[0]);
        set(dw, out, inp, std::mem::take(&mut r[1]));
        db.copy_from_slice(&r[2]);
        if let Some(dx) = dx {
            set(dx, n, inp, std::mem::take(&mut r[3]));
        }
    }

    fn dot_interaction_forward(
        &self,
        dense: &Tensor<f32>,
        sparse: &Tensor<f32>,
        out: &mut Tensor<f32>,
    ) {
        let (n, d) = (dense.rows(), dense.cols());
        let fk = sparse.cols() / d.max(1);
        let w = d + (fk + 1) * fk / 2;
        let mut f = Func::new();
        let (pd, ps) = (f.arg(&[n, d]), f.arg(&[n, fk * d]));
        let o = lower::dot_interaction_forward(&mut f, &pd, &ps, n, fk, d);
        let program = f.finish(&[(o, vec![n, w])]);
        let r = self
            .run(
                &program,
                &[(dense.data(), &[n, d]), (sparse.data(), &[n, fk * d])],
            )
            .remove(0);
        set(out, n, w, r);
    }

    fn dot_interaction_backward(
        &self,
        dense: &Tensor<f32>,
        sparse: &Tensor<f32>,
        dout: &Tensor<f32>,
        ddense: &mut Tensor<f32>,
        dsparse: &mut Tensor<f32>,
    ) {
        let (n, d) = (dense.rows(), dense.cols());
        let fk = sparse.cols() / d.max(1);
        let np = (fk + 1) * fk / 2;
        let mut f = Func::new();
        let (pd, ps, pg) = (f.arg(&[n, d]), f.arg(&[n, fk * d]), f.arg(&[n, d + np]));
        let (gd, gsp) = lower::dot_interaction_backward(&mut f, &pd, &ps, &pg, n, fk, d);
        let program = f.finish(&[(gd, vec![n, d]), (gsp, vec![n, fk * d])]);
        let mut r = self.run(
            &program,
            &[
                (dense.data(), &[n, d]),
                (sparse.data(), &[n, fk * d]),
                (dout.data(), &[n, d + np]),
            ],
        );
        set(ddense, n, d, std::mem::take(&mut r[0]));
        set(dsparse, n, fk * d, std::mem::take(&mut r[1]));
    }

    fn cross_combine_forward(
        &self,
        x0: &Tensor<f32>,
        h: &Tensor<f32>,
        b: &[f32],
        xl: &Tensor<f32>,
        out: &mut Tensor<f32>,
    ) {
        let (n, c) = (x0.rows(), x0.cols());
        let dims = [n, c];
        let mut f = Func::new();
        let (p0, ph, pb, pl) = (f.arg(&dims), f.arg(&dims), f.arg(&[c]), f.arg(&dims));
        let o = lower::cross_combine_forward(&mut f, &p0, &ph, &pb, &pl, n, c);
        let program = f.finish(&[(o, dims.to_vec())]);
        let r = self
            .run(
                &program,
                &[
                    (x0.data(), &dims),
                    (h.data(), &dims),
                    (b, &[c]),
                    (xl.data(), &dims),
                ],
            )
            .remove(0);
        set(out, n, c, r);
    }

    fn cross_combine_backward(
        &self,
        x0: &Tensor<f32>,
        h: &Tensor<f32>,
        b: &[f32],
        dout: &Tensor<f32>,
        dh: &mut Tensor<f32>,
        db: &mut [f32],
        dx0: &mut Tensor<f32>,
    ) {
        let (n, c) = (x0.rows(), x0.cols());
        let dims = [n, c];
        let mut f = Func::new();
        let (p0, ph, pb, pg, pdx) = (
            f.arg(&dims),
            f.arg(&dims),
            f.arg(&[c]),
            f.arg(&dims),
            f.arg(&dims),
        );
        let (gh, gb, gx) = lower::cross_combine_backward(&mut f, &p0, &ph, &pb, &pg, &pdx, n, c);
        let program = f.finish(&[(gh, dims.to_vec()), (gb, vec![c]), (gx, dims.to_vec())]);
        let mut r = self.run(
            &program,
            &[
                (x0.data(), &dims),
                (h.data(), &dims),
                (b, &[c]),
                (dout.data(), &dims),
                (dx0.data(), &dims),
            ],
        );
        set(dh, n, c, std::mem::take(&mut r[0]));
        db.copy_from_slice(&r[1]);
        dx0.data_mut().copy_from_slice(&r[2]);
    }

    fn add_assign(&self, y: &mut Tensor<f32>, x: &Tensor<f32>) {
        assert_eq!(y.shape(), x.shape(), "add_assign: shapes differ");
        let dims = [y.rows(), y.cols()];
        let mut f = Func::new();
        let (a, b) = (f.arg(&dims), f.arg(&dims));
        let s = f.binary("add", &a, &b, &dims);
        let program = f.finish(&[(s, dims.to_vec())]);
        let r = self
            .run(&program, &[(y.data(), &dims), (x.data(), &dims)])
            .remove(0);
        y.data_mut().copy_from_slice(&r);
    }

    fn bce_with_logits(&self, logits: &[f32], labels: &[f32], dlogits: &mut [f32]) -> f32 {
        let n = logits.len();
        let dims = [n];
        let mut f = Func::new();
        let (z, y) = (f.arg(&dims), f.arg(&dims));
        let (loss, g) = lower::bce_with_logits(&mut f, &z, &y, n);
        let program = f.finish(&[(loss, vec![]), (g, dims.to_vec())]);
        let r = self.run(&program, &[(logits, &dims), (labels, &dims)]);
        dlogits.copy_from_slice(&r[1]);
        r[0][0]
    }
}
