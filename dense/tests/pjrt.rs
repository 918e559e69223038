//! The PJRT runtime against the CPU plugin: load, devices, compile, execute,
//! serialize, and errors. The plugin comes from scripts/fetch-pjrt-plugin.sh;
//! CI sets EMBER_REQUIRE_PJRT=1 so that a missing plugin fails there instead
//! of skipping.

use std::path::Path;

use ember_dense::pjrt::{plugin_for_tests, Client, PjrtError, Plugin};
use ember_dense::{Activation, DenseBackend, NativeBackend, Tensor};

fn client() -> Option<Client> {
    let path = plugin_for_tests()?;
    Some(Client::new(Plugin::load(&path).expect("the plugin loads")).expect("a client"))
}

const LINEAR_RELU: &str = r#"
module @linear {
  func.func public @main(%x: tensor<4x3xf32>, %w: tensor<2x3xf32>, %b: tensor<2xf32>) -> (tensor<4x2xf32>, tensor<4x2xf32>) {
    %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [1] : (tensor<4x3xf32>, tensor<2x3xf32>) -> tensor<4x2xf32>
    %1 = stablehlo.broadcast_in_dim %b, dims = [1] : (tensor<2xf32>) -> tensor<4x2xf32>
    %2 = stablehlo.add %0, %1 : tensor<4x2xf32>
    %z = stablehlo.constant dense<0.0> : tensor<4x2xf32>
    %3 = stablehlo.maximum %2, %z : tensor<4x2xf32>
    return %3, %2 : tensor<4x2xf32>, tensor<4x2xf32>
  }
}
"#;

#[test]
fn cpu_plugin_compiles_and_runs_stablehlo_like_the_native_backend() {
    let Some(client) = client() else { return };
    assert_eq!(client.platform_name().unwrap(), "cpu");
    let (major, minor) = client.plugin().api_version();
    assert_eq!(major, 0);
    assert!(minor <= 81);
    let devices = client.devices().unwrap();
    assert!(!devices.is_empty());

    let x = Tensor::from_vec(4, 3, (0..12).map(|i| i as f32 * 0.25 - 1.0).collect()).unwrap();
    let w = Tensor::from_vec(2, 3, vec![0.5, -1.0, 0.25, 1.5, 0.75, -0.5]).unwrap();
    let b = vec![0.1f32, -0.2];
    let mut want = Tensor::zeros(0, 0);
    NativeBackend::new(1).linear_forward(&x, &w, &b, Activation::Relu, &mut want);

    let exe = client.compile(LINEAR_RELU).unwrap();
    assert_eq!(exe.num_outputs(), 2);
    let args = [
        client.buffer_f32(x.data(), &[4, 3]).unwrap(),
        client.buffer_f32(w.data(), &[2, 3]).unwrap(),
        client.buffer_f32(&b, &[2]).unwrap(),
    ];
    let refs: Vec<_> = args.iter().collect();
    let out = exe.execute(&refs).unwrap();
    assert_eq!(out[0].dims().unwrap(), vec![4, 2]);
    let got = out[0].to_f32().unwrap();
    for (g, w) in got.iter().zip(want.data()) {
        assert!((g - w).abs() <= 1e-6 * (1.0 + w.abs()), "{g} vs {w}");
    }
    let pre = out[1].to_f32().unwrap();
    assert!(pre.iter().zip(&got).all(|(p, r)| p.max(0.0) == *r));

    // Serialized and loaded again: the same results (the compile cache's basis).
    let bytes = exe.serialize().unwrap();
    assert!(!bytes.is_empty());
    let again = client.deserialize(&bytes).unwrap();
    assert_eq!(again.execute(&refs).unwrap()[0].to_f32().unwrap(), got);
}

#[test]
fn bad_plugins_and_programs_are_named() {
    let err = Plugin::load(Path::new("/nonexistent/plugin.so"))
        .err()
        .unwrap();
    assert!(err.to_string().contains("/nonexistent/plugin.so"), "{err}");
    // A real shared library that is not a PJRT plugin.
    let libc = [
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
    ]
    .into_iter()
    .find(|p| Path::new(p).is_file());
    if let Some(libc) = libc {
        let err = Plugin::load(Path::new(libc)).err().unwrap();
        assert!(
            matches!(err, PjrtError::Load { .. }) && err.to_string().contains("GetPjrtApi"),
            "{err}"
        );
    }
    let Some(client) = client() else { return };
    let err = client.compile("this is not stablehlo").err().unwrap();
    assert!(err.to_string().contains("PJRT_Client_Compile"), "{err}");
    let err = client.buffer_f32(&[1.0, 2.0], &[3]).err().unwrap();
    assert!(err.to_string().contains("shape [3]"), "{err}");
}

#[test]
fn pjrt_backend_passes_the_conformance_suite() {
    let Some(client) = client() else { return };
    let be = ember_dense::pjrt::PjrtBackend::new(client);
    let checked = ember_dense::conformance::run_all(&be).unwrap_or_else(|e| panic!("{e}"));
    assert!(checked > 0);
    let s = be.stats();
    assert!(s.compiles > 0 && s.executions >= s.compiles);
}

#[test]
fn a_fused_window_is_one_execution_and_a_panic_discards_it() {
    let Some(client) = client() else { return };
    let be = ember_dense::pjrt::PjrtBackend::new(client);
    let x = Tensor::from_vec(2, 2, vec![1.0, -2.0, 3.0, 0.5]).unwrap();
    let w = Tensor::from_vec(2, 2, vec![0.1, 0.2, -0.3, 0.4]).unwrap();
    let b = [0.5f32, -0.5];
    let (mut y, mut z) = (Tensor::zeros(0, 0), Tensor::zeros(0, 0));
    let eager = |y: &mut Tensor<f32>, z: &mut Tensor<f32>| {
        be.linear_forward(&x, &w, &b, Activation::Relu, y);
        be.linear_forward(y, &w, &b, Activation::None, z);
        be.add_assign(z, &x);
    };
    eager(&mut y, &mut z);
    let want = (y.clone(), z.clone());
    let before = be.stats().executions;
    let (mut fy, mut fz) = (Tensor::zeros(0, 0), Tensor::zeros(0, 0));
    // SAFETY: the ops' tensors outlive the call and are touched through ops only.
    unsafe { be.fused(&mut || eager(&mut fy, &mut fz)) };
    assert_eq!(be.stats().executions, before + 1, "three ops, one window");
    // XLA may fuse differently from the per-op programs (rounding).
    let close = |a: &Tensor<f32>, b: &Tensor<f32>| {
        a.shape() == b.shape()
            && (a.data().iter().zip(b.data())).all(|(x, y)| (x - y).abs() <= 1e-6 * (1.0 + y.abs()))
    };
    assert!(
        close(&fy, &want.0) && close(&fz, &want.1),
        "{fy:?} {fz:?} vs {want:?}"
    );

    // A body that panics leaves nothing behind: the next window runs clean.
    let mut dead = Tensor::zeros(0, 0);
    // SAFETY: `dead` outlives the call, and the body touches it through ops only.
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe {
        be.fused(&mut || {
            be.linear_forward(&x, &w, &b, Activation::Relu, &mut dead);
            panic!("the body fails");
        })
    }));
    assert!(panicked.is_err());
    drop(dead);
    let before = be.stats().executions;
    let (mut gy, mut gz) = (Tensor::zeros(0, 0), Tensor::zeros(0, 0));
    // SAFETY: as the first window's, above.
    unsafe { be.fused(&mut || eager(&mut gy, &mut gz)) };
    assert_eq!(be.stats().executions, before + 1);
    assert!(close(&gy, &want.0) && close(&gz, &want.1));
}

#[test]
fn compiled_executables_are_cached_on_disk_and_bad_entries_recompiled() {
    use ember_dense::pjrt::PjrtBackend;
    let Some(first) = client() else { return };
    let dir = std::env::temp_dir().join(format!("ember-pjrt-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let x = Tensor::from_vec(3, 2, vec![1.0, -2.0, 3.0, 0.5, -1.0, 2.0]).unwrap();
    let w = Tensor::from_vec(4, 2, vec![0.1, 0.2, -0.3, 0.4, 0.5, -0.6, 0.7, 0.8]).unwrap();
    let b = [0.0f32, 0.1, -0.1, 0.2];
    let run = |be: &PjrtBackend| {
        let mut y = Tensor::zeros(0, 0);
        be.linear_forward(&x, &w, &b, Activation::Relu, &mut y);
        y.into_vec()
    };
    let a = PjrtBackend::with_disk_cache(first, dir.clone());
    let want = run(&a);
    assert_eq!((a.stats().compiles, a.stats().compile_cache_hits), (1, 0));
    // A later process (here: a new client) loads instead of compiling.
    let b2 = PjrtBackend::with_disk_cache(client().unwrap(), dir.clone());
    assert_eq!(run(&b2), want);
    assert_eq!((b2.stats().compiles, b2.stats().compile_cache_hits), (0, 1));
    // Corrupt entries are detected and recompiled, never a crash.
    for corrupt in [&b"garbage"[..], &[]] {
        for entry in std::fs::read_dir(&dir).unwrap() {
            std::fs::write(entry.unwrap().path(), corrupt).unwrap();
        }
        let c = PjrtBackend::with_disk_cache(client().unwrap(), dir.clone());
        assert_eq!(run(&c), want);
        assert_eq!((c.stats().compiles, c.stats().compile_cache_hits), (1, 0));
    }
    // A flipped byte inside the stored executable fails the checksum.
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let mut bytes = std::fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0xff;
        std::fs::write(&path, bytes).unwrap();
    }
    let d = PjrtBackend::with_disk_cache(client().unwrap(), dir.clone());
    assert_eq!(run(&d), want);
    assert_eq!(d.stats().compiles, 1);
    std::fs::remove_dir_all(&dir).ok();
}

/// A user's host op sees every earlier op's output outside a window, and is
/// refused (naming it) inside one, where those outputs are not written yet.
#[test]
fn host_ops_run_eagerly_and_are_refused_inside_fused_windows() {
    let Some(client) = client() else { return };
    let be = ember_dense::pjrt::PjrtBackend::new(client);
    let (a, b) = (
        Tensor::from_vec(1, 2, vec![1.0, 2.0]).unwrap(),
        Tensor::from_vec(1, 1, vec![3.0]).unwrap(),
    );
    let mut joined = Tensor::zeros(0, 0);
    be.concat_columns(&a, &b, &mut joined);
    let mut sum = 0.0;
    be.host_op("sum", &mut || sum = joined.data().iter().sum());
    assert_eq!(sum, 6.0);
    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut body = || be.host_op("my_op", &mut || {});
        // SAFETY: the body's op touches no buffer.
        unsafe { be.fused(&mut body) };
    }));
    let message = refused.expect_err("refused in a window");
    let text = message
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert!(text.contains("my_op") && text.contains("strict"), "{text}");
}
