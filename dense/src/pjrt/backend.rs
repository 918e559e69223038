//! `PjrtBackend`: the dense ops of [`DenseBackend`] as StableHLO, compiled by
//! a PJRT plugin and cached in memory (and on disk) by program text.
//!
//! Every op is recorded into a [`Window`]. Eagerly (`--mode strict`) each op
//! is its own window, run before the op returns: one executable per (op,
//! shape). Inside [`DenseBackend::fused`] (`--mode defer-fuse`) the window
//! collects every op the calling thread issues in the body (other threads'
//! ops stay eager) and runs them as one executable at its end,
//! so XLA fuses across ops and intermediate values never leave the device
//! until the window writes them back.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::ThreadId;
use std::time::Instant;

use super::cache::{plugin_identity, DiskCache};
use super::lower;
use super::runtime::{Client, Executable, PjrtError, COMPILE_OPTIONS};
use super::window::Window;
use crate::backend::{Activation, DenseBackend};
use crate::tensor::Tensor;

/// Counters of the executable caches.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct CompileStats {
    /// Programs compiled by the plugin.
    pub compiles: u64,
    /// Wall time spent compiling them, in milliseconds.
    pub compile_ms: f64,
    /// Programs loaded from the on-disk cache instead of compiled.
    pub compile_cache_hits: u64,
    /// Wall time spent loading them, in milliseconds.
    pub cache_load_ms: f64,
    /// Windows run: one per op when eager, one per fused body otherwise.
    pub executions: u64,
}

/// The window [`DenseBackend::fused`] opened, if any.
#[derive(Default)]
struct Recorder {
    open: Option<OpenWindow>,
}

struct OpenWindow {
    /// Only this thread's ops go into the window; other threads' run eagerly.
    owner: ThreadId,
    window: Window,
    /// An op of the window failed: its outputs can never be written, so the
    /// window must not run and the rest of its ops fail too.
    broken: bool,
}

/// A [`DenseBackend<f32>`] that runs every op as a StableHLO program compiled by a PJRT
/// plugin, on device 0 of its [`Client`]. `f32` only.
///
/// Eagerly, each op is compiled once per shape and run before it returns. Inside
/// [`DenseBackend::fused`], the calling thread's ops are recorded and run as one program when
/// the body ends (windows do not nest; [`DenseBackend::host_op`] panics inside one).
/// Executables are cached by program text in memory, and on disk with
/// [`PjrtBackend::with_disk_cache`]; [`PjrtBackend::stats`] counts compiles and runs.
pub struct PjrtBackend {
    client: Client,
    cache: Mutex<HashMap<String, Arc<Executable>>>,
    disk: Option<DiskCache>,
    stats: Mutex<CompileStats>,
    recorder: Mutex<Recorder>,
}

impl PjrtBackend {
    /// A backend with an in-memory executable cache only.
    pub fn new(client: Client) -> Self {
        Self {
            client,
            cache: Mutex::new(HashMap::new()),
            disk: None,
            stats: Mutex::new(CompileStats::default()),
            recorder: Mutex::new(Recorder::default()),
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

    /// The client the programs are compiled and run on.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The counters so far (a copy).
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

    /// The recorder. A panic while it was held (an op of the open window
    /// failed) breaks the open window.
    fn recorder(&self) -> MutexGuard<'_, Recorder> {
        self.recorder.lock().unwrap_or_else(|poisoned| {
            self.recorder.clear_poison();
            let mut r = poisoned.into_inner();
            if let Some(open) = &mut r.open {
                open.broken = true;
            }
            r
        })
    }

    /// Is this thread inside a window of [`DenseBackend::fused`]?
    fn deferring(&self) -> bool {
        let me = std::thread::current().id();
        matches!(&self.recorder().open, Some(o) if o.owner == me)
    }

    /// Runs the window. A PJRT failure here is a bug in Ember or the plugin
    /// (the trait's ops are infallible), so it panics with the plugin's message.
    fn run_window(&self, window: &mut Window) {
        match window.run(|program| self.executable(program)) {
            Ok(ran) => self.stats.lock().expect("stats lock").executions += ran as u64,
            Err(e) => panic!("PJRT backend: {e}"),
        }
    }

    /// Records one op into this thread's open window, or runs it at once in
    /// a window of its own.
    fn record(&self, op: impl FnOnce(&mut Window, &Client) -> Result<(), PjrtError>) {
        let me = std::thread::current().id();
        let mut r = self.recorder();
        match &mut r.open {
            Some(open) if open.owner == me => {
                if open.broken {
                    drop(r);
                    panic!("PJRT backend: an earlier op of this fused window failed");
                }
                if let Err(e) = op(&mut open.window, &self.client) {
                    open.broken = true;
                    drop(r);
                    panic!("PJRT backend: {e}");
                }
            }
            _ => {
                drop(r);
                let mut window = Window::default();
                if let Err(e) = op(&mut window, &self.client) {
                    panic!("PJRT backend: {e}");
                }
                self.run_window(&mut window);
            }
        }
    }
}

fn dims(t: &Tensor<f32>) -> [usize; 2] {
    [t.rows(), t.cols()]
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
        let (ad, bd) = (dims(a), dims(b));
        let k = if trans_a { ad[0] } else { ad[1] };
        let kb = if trans_b { bd[1] } else { bd[0] };
        assert_eq!(k, kb, "matmul: inner dims {k} and {kb} differ");
        self.record(|w, client| {
            let (pa, pb) = (
                w.read(client, a.data(), &ad)?,
                w.read(client, b.data(), &bd)?,
            );
            let pc = if beta != 0.0 {
                Some(w.read(client, c.data(), &dims(c))?)
            } else {
                None
            };
            let (out, od) = lower::matmul(
                &mut w.f,
                &pa,
                &ad,
                trans_a,
                &pb,
                &bd,
                trans_b,
                alpha,
                pc.as_deref().map(|pc| (pc, beta)),
            );
            if pc.is_some() {
                assert_eq!(
                    dims(c).to_vec(),
                    od,
                    "matmul: c must be the product's shape when beta != 0"
                );
            }
            w.write_tensor(c, od[0], od[1], out);
            Ok(())
        });
    }

    fn linear_forward(
        &self,
        x: &Tensor<f32>,
        wt: &Tensor<f32>,
        b: &[f32],
        act: Activation,
        y: &mut Tensor<f32>,
    ) {
        let (n, inp, out) = (x.rows(), x.cols(), wt.rows());
        assert!(
            wt.cols() == inp && b.len() == out,
            "linear_forward: x {:?}, weight {:?}, bias [{}]",
            dims(x),
            dims(wt),
            b.len()
        );
        self.record(|w, client| {
            let px = w.read(client, x.data(), &[n, inp])?;
            let pw = w.read(client, wt.data(), &[out, inp])?;
            let pb = w.read(client, b, &[out])?;
            let r = lower::linear_forward(&mut w.f, &px, &pw, &pb, n, inp, out, act);
            w.write_tensor(y, n, out, r);
            Ok(())
        });
    }

    fn linear_backward(
        &self,
        x: &Tensor<f32>,
        wt: &Tensor<f32>,
        y: &Tensor<f32>,
        act: Activation,
        dy: &mut Tensor<f32>,
        dw: &mut Tensor<f32>,
        db: &mut [f32],
        dx: Option<&mut Tensor<f32>>,
    ) {
        let (n, inp, out) = (x.rows(), x.cols(), wt.rows());
        let no = [n, out];
        assert!(
            dims(y) == no && dims(dy) == no && db.len() == out,
            "linear_backward: y {:?}, dy {:?}, db [{}] for [{n}, {out}]",
            dims(y),
            dims(dy),
            db.len()
        );
        self.record(|w, client| {
            let px = w.read(client, x.data(), &[n, inp])?;
            let pw = w.read(client, wt.data(), &[out, inp])?;
            let py = w.read(client, y.data(), &no)?;
            let pdy = w.read(client, dy.data(), &no)?;
            let (dz, gw, gb, gx) = lower::linear_backward(
                &mut w.f,
                &px,
                &pw,
                &py,
                &pdy,
                n,
                inp,
                out,
                act,
                dx.is_some(),
            );
            w.write(dy.data_mut(), &no, dz);
            w.write_tensor(dw, out, inp, gw);
            w.write(db, &[out], gb);
            if let (Some(dx), Some(gx)) = (dx, gx) {
                w.write_tensor(dx, n, inp, gx);
            }
            Ok(())
        });
    }

    fn dot_interaction_forward(
        &self,
        dense: &Tensor<f32>,
        sparse: &Tensor<f32>,
        out: &mut Tensor<f32>,
    ) {
        let (n, d) = (dense.rows(), dense.cols());
        let fk = sparse.cols() / d.max(1);
        self.record(|w, client| {
            let pd = w.read(client, dense.data(), &[n, d])?;
            let ps = w.read(client, sparse.data(), &[n, fk * d])?;
            let o = lower::dot_interaction_forward(&mut w.f, &pd, &ps, n, fk, d);
            w.write_tensor(out, n, d + (fk + 1) * fk / 2, o);
            Ok(())
        });
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
        self.record(|w, client| {
            let pd = w.read(client, dense.data(), &[n, d])?;
            let ps = w.read(client, sparse.data(), &[n, fk * d])?;
            let pg = w.read(client, dout.data(), &[n, d + np])?;
            let (gd, gsp) = lower::dot_interaction_backward(&mut w.f, &pd, &ps, &pg, n, fk, d);
            w.write_tensor(ddense, n, d, gd);
            w.write_tensor(dsparse, n, fk * d, gsp);
            Ok(())
        });
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
        let dm = [n, c];
        self.record(|w, client| {
            let p0 = w.read(client, x0.data(), &dm)?;
            let ph = w.read(client, h.data(), &dm)?;
            let pb = w.read(client, b, &[c])?;
            let pl = w.read(client, xl.data(), &dm)?;
            let o = lower::cross_combine_forward(&mut w.f, &p0, &ph, &pb, &pl, n, c);
            w.write_tensor(out, n, c, o);
            Ok(())
        });
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
        let dm = [n, c];
        assert!(
            dims(dx0) == dm && db.len() == c,
            "cross_combine_backward: dx0 {:?} and db [{}] for x0 {dm:?}",
            dims(dx0),
            db.len()
        );
        self.record(|w, client| {
            let p0 = w.read(client, x0.data(), &dm)?;
            let ph = w.read(client, h.data(), &dm)?;
            let pb = w.read(client, b, &[c])?;
            let pg = w.read(client, dout.data(), &dm)?;
            let pdx = w.read(client, dx0.data(), &dm)?;
            let (gh, gb, gx) =
                lower::cross_combine_backward(&mut w.f, &p0, &ph, &pb, &pg, &pdx, n, c);
            w.write_tensor(dh, n, c, gh);
            w.write(db, &[c], gb);
            w.write(dx0.data_mut(), &dm, gx);
            Ok(())
        });
    }

    fn add_assign(&self, y: &mut Tensor<f32>, x: &Tensor<f32>) {
        assert_eq!(y.shape(), x.shape(), "add_assign: shapes differ");
        let dm = dims(y);
        self.record(|w, client| {
            let (a, b) = (
                w.read(client, y.data(), &dm)?,
                w.read(client, x.data(), &dm)?,
            );
            let s = w.f.binary("add", &a, &b, &dm);
            w.write(y.data_mut(), &dm, s);
            Ok(())
        });
    }

    fn bce_with_logits(
        &self,
        logits: &[f32],
        labels: &[f32],
        dlogits: &mut Tensor<f32>,
        loss: &mut f32,
    ) {
        let n = logits.len();
        assert!(
            labels.len() == n,
            "bce_with_logits: logits [{n}], labels [{}]",
            labels.len(),
        );
        self.record(|w, client| {
            let z = w.read(client, logits, &[n])?;
            let y = w.read(client, labels, &[n])?;
            let (l, g) = lower::bce_with_logits(&mut w.f, &z, &y, n);
            let g = w.f.reshape(&g, &[n], &[n, 1]);
            w.write_tensor(dlogits, n, 1, g);
            w.write(std::slice::from_mut(loss), &[], l);
            Ok(())
        });
    }

    // The data movements run on the host when eager (a device round trip
    // would only add copies); in a window they are values, mostly free.

    fn copy(&self, dst: &mut Tensor<f32>, src: &Tensor<f32>) {
        if !self.deferring() {
            return dst.copy_from(src);
        }
        self.record(|w, client| {
            let v = w.read(client, src.data(), &dims(src))?;
            w.write_tensor(dst, src.rows(), src.cols(), v);
            Ok(())
        });
    }

    fn zeros(&self, t: &mut Tensor<f32>, rows: usize, cols: usize) {
        if !self.deferring() {
            t.resize(rows, cols);
            return t.fill(0.0);
        }
        self.record(|w, _| {
            let z = w.f.splat(0.0, &[rows, cols]);
            w.write_tensor(t, rows, cols, z);
            Ok(())
        });
    }

    fn concat_columns(&self, a: &Tensor<f32>, b: &Tensor<f32>, out: &mut Tensor<f32>) {
        assert_eq!(a.rows(), b.rows(), "concat_columns: a and b differ in rows");
        if !self.deferring() {
            return out.concat_columns_of(a, b);
        }
        let (n, ca, cb) = (a.rows(), a.cols(), b.cols());
        self.record(|w, client| {
            let (pa, pb) = (
                w.read(client, a.data(), &[n, ca])?,
                w.read(client, b.data(), &[n, cb])?,
            );
            let v = lower::concat_columns(&mut w.f, &pa, &pb, n, ca, cb);
            w.write_tensor(out, n, ca + cb, v);
            Ok(())
        });
    }

    fn split_columns(
        &self,
        x: &Tensor<f32>,
        cols_a: usize,
        a: &mut Tensor<f32>,
        b: &mut Tensor<f32>,
    ) {
        let (n, cols) = (x.rows(), x.cols());
        assert!(
            cols_a <= cols,
            "split_columns: {cols_a} columns of [{n}, {cols}]"
        );
        if !self.deferring() {
            return x.split_columns_into(cols_a, a, b);
        }
        self.record(|w, client| {
            let px = w.read(client, x.data(), &[n, cols])?;
            let va = lower::slice_columns(&mut w.f, &px, n, cols, 0, cols_a);
            let vb = lower::slice_columns(&mut w.f, &px, n, cols, cols_a, cols);
            w.write_tensor(a, n, cols_a, va);
            w.write_tensor(b, n, cols - cols_a, vb);
            Ok(())
        });
    }

    fn host_op(&self, name: &str, op: &mut dyn FnMut()) {
        let me = std::thread::current().id();
        let in_window = matches!(&self.recorder().open, Some(o) if o.owner == me);
        assert!(
            !in_window,
            "host op '{name}' inside a fused window: its inputs are written only when the window ends (run it in strict or debug mode)"
        );
        op()
    }

    unsafe fn fused(&self, body: &mut dyn FnMut()) {
        let me = std::thread::current().id();
        {
            let mut r = self.recorder();
            match &r.open {
                Some(open) if open.owner == me => {
                    drop(r);
                    panic!("PjrtBackend::fused: windows do not nest");
                }
                // Another thread's window is open: this body runs eagerly.
                Some(_) => {
                    drop(r);
                    return body();
                }
                None => {
                    r.open = Some(OpenWindow {
                        owner: me,
                        window: Window::default(),
                        broken: false,
                    })
                }
            }
        }
        // Closes the window however `body` ends; after a panic the ops
        // recorded so far are discarded, never run into buffers that may be gone.
        struct Close<'a>(&'a PjrtBackend, ThreadId);
        impl Drop for Close<'_> {
            fn drop(&mut self) {
                let mut r = self.0.recorder();
                if matches!(&r.open, Some(o) if o.owner == self.1) {
                    r.open = None;
                }
            }
        }
        let close = Close(self, me);
        body();
        let open = self
            .recorder()
            .open
            .take()
            .expect("the window this call opened");
        drop(close);
        if open.broken {
            panic!(
                "PJRT backend: an op of the fused window failed; none of its outputs was written"
            );
        }
        let mut window = open.window;
        self.run_window(&mut window);
    }
}
