//! Layer behaviour that is not numerics: seeding, initialization, names, buffer reuse, shapes.

use ember_dense::{
    Activation, DenseBackend, DotInteraction, HasParams, Linear, LowRankCrossNet, Mlp,
    NativeBackend, Tensor,
};

#[test]
fn same_seed_same_weights() {
    let a = Mlp::<f32>::new(&[13, 64, 16], Activation::Relu, 42);
    let b = Mlp::<f32>::new(&[13, 64, 16], Activation::Relu, 42);
    let c = Mlp::<f32>::new(&[13, 64, 16], Activation::Relu, 43);
    for (la, lb) in a.layers().iter().zip(b.layers()) {
        assert_eq!(la.weight, lb.weight);
        assert_eq!(la.bias, lb.bias);
    }
    assert_ne!(a.layers()[0].weight, c.layers()[0].weight);

    let x = LowRankCrossNet::<f64>::new(10, 2, 3, 5);
    let y = LowRankCrossNet::<f64>::new(10, 2, 3, 5);
    assert_eq!(x.w_kernels, y.w_kernels);
    assert_eq!(x.v_kernels, y.v_kernels);
    assert_ne!(
        x.w_kernels[0], x.w_kernels[1],
        "layers draw different values"
    );
}

#[test]
fn linear_init_is_torch_uniform() {
    let l = Linear::<f64>::new(400, 300, Activation::None, 1);
    let bound = 1.0 / 20.0;
    let w = l.weight.data();
    assert!(w.iter().chain(&l.bias).all(|v| v.abs() <= bound));
    let mean = w.iter().sum::<f64>() / w.len() as f64;
    let var = w.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / w.len() as f64;
    // U(-a, a) has variance a²/3.
    assert!(mean.abs() < 1e-3, "mean {mean}");
    assert!(
        (var / (bound * bound / 3.0) - 1.0).abs() < 0.02,
        "var {var}"
    );
}

#[test]
fn crossnet_init_is_xavier_normal_with_zero_bias() {
    let (inp, rank) = (500, 100);
    let net = LowRankCrossNet::<f64>::new(inp, 1, rank, 3);
    let want_var = 2.0 / (inp + rank) as f64;
    for k in [&net.w_kernels[0], &net.v_kernels[0]] {
        let d = k.data();
        let mean = d.iter().sum::<f64>() / d.len() as f64;
        let var = d.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d.len() as f64;
        assert!(mean.abs() < 2e-3, "mean {mean}");
        assert!(
            (var / want_var - 1.0).abs() < 0.02,
            "var {var} want {want_var}"
        );
    }
    assert_eq!(net.w_kernels[0].shape(), (inp, rank));
    assert_eq!(net.v_kernels[0].shape(), (rank, inp));
    assert!(net.bias[0].iter().all(|&b| b == 0.0));
}

#[test]
fn param_names_follow_torchrec() {
    let mut mlp = Mlp::<f32>::new(&[3, 4, 2], Activation::None, 0);
    let names: Vec<String> = mlp.params().into_iter().map(|p| p.name).collect();
    assert_eq!(
        names,
        [
            "_mlp.0._linear.weight",
            "_mlp.0._linear.bias",
            "_mlp.1._linear.weight",
            "_mlp.1._linear.bias"
        ]
    );
    let mut net = LowRankCrossNet::<f32>::new(4, 2, 2, 0);
    let params = net.params();
    let names: Vec<&str> = params.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "W_kernels.0",
            "W_kernels.1",
            "V_kernels.0",
            "V_kernels.1",
            "bias.0",
            "bias.1"
        ]
    );
    assert_eq!(params[0].value.len(), 8);
    let p = Mlp::<f32>::new(&[3, 2], Activation::None, 0).layers()[0].clone();
    let mut p = p;
    let names: Vec<String> = p
        .params()
        .into_iter()
        .map(|p| p.with_prefix("over_arch.").name)
        .collect();
    assert_eq!(names, ["over_arch.weight", "over_arch.bias"]);
}

#[test]
fn mlp_shapes_and_activations() {
    let be = NativeBackend::new(1);
    let mut bottom = Mlp::<f32>::new(&[13, 512, 256, 64, 16], Activation::Relu, 1);
    assert_eq!(bottom.sizes(), [13, 512, 256, 64, 16]);
    assert!(bottom
        .layers()
        .iter()
        .all(|l| l.activation() == Activation::Relu));
    let top = Mlp::<f32>::new(&[367, 512, 256, 1], Activation::None, 1);
    let acts: Vec<Activation> = top.layers().iter().map(|l| l.activation()).collect();
    assert_eq!(acts, [Activation::Relu, Activation::Relu, Activation::None]);

    let x = Tensor::from_fn(7, 13, |r, c| (r as f32 - c as f32) * 0.1);
    let y = bottom.forward(&be, &x);
    assert_eq!(y.shape(), (7, 16));
    assert!(y.data().iter().all(|&v| v >= 0.0));
    assert!(bottom.backward(&be, &Tensor::zeros(7, 16), false).is_none());
    assert_eq!(
        bottom
            .backward(&be, &Tensor::zeros(7, 16), true)
            .unwrap()
            .shape(),
        (7, 13)
    );
}

/// After the first step at a batch size, forward and backward reuse every buffer.
#[test]
fn steady_state_reuses_buffers() {
    let be = NativeBackend::new(2);
    let mut mlp = Mlp::<f32>::new(&[20, 32, 8], Activation::Relu, 1);
    let mut inter = DotInteraction::<f32>::new(3, 8);
    let x = Tensor::from_fn(64, 20, |r, c| ((r * 7 + c) % 5) as f32 - 2.0);
    let emb = Tensor::from_fn(64, 24, |r, c| ((r + c * 3) % 7) as f32 * 0.1);
    let mut ptrs = Vec::new();
    for _ in 0..3 {
        let out_ptr = mlp.forward(&be, &x).data().as_ptr();
        let dense = mlp.output().clone();
        let z_ptr = inter.forward(&be, &dense, &emb).data().as_ptr();
        let dz = Tensor::from_fn(64, inter.output_dim(), |_, c| c as f32 * 0.01);
        let (dd, ds) = inter.backward(&be, &dz);
        let (dd_ptr, ds_ptr, dd) = (dd.data().as_ptr(), ds.data().as_ptr(), dd.clone());
        let dx_ptr = mlp.backward(&be, &dd, true).unwrap().data().as_ptr();
        let wg_ptr = mlp.layers()[0].weight_grad.data().as_ptr();
        ptrs.push([out_ptr, z_ptr, dd_ptr, ds_ptr, dx_ptr, wg_ptr]);
    }
    assert_eq!(ptrs[0], ptrs[1]);
    assert_eq!(ptrs[1], ptrs[2]);
}

#[test]
#[should_panic(expected = "Mlp::forward: shape mismatch: input [2, 5]")]
fn wrong_input_width_names_the_layer() {
    let be = NativeBackend::new(1);
    Mlp::<f32>::new(&[4, 3], Activation::None, 0).forward(&be, &Tensor::zeros(2, 5));
}

#[test]
#[should_panic(expected = "matmul: shape mismatch")]
fn matmul_shape_mismatch_panics_with_shapes() {
    let be = NativeBackend::new(1);
    let mut c = Tensor::<f32>::zeros(0, 0);
    be.matmul(
        &Tensor::zeros(2, 3),
        false,
        &Tensor::zeros(2, 3),
        false,
        1.0,
        0.0,
        &mut c,
    );
}

#[test]
fn interaction_output_dim_is_torchrec_kaggle() {
    assert_eq!(DotInteraction::<f32>::new(26, 16).output_dim(), 367);
}

/// `Sequential` chains its modules exactly as calling them by hand does,
/// and every module's read-only views agree with its parameters.
#[test]
fn sequential_matches_modules_called_by_hand_and_views_match_params() {
    use ember_dense::{HasParams, LowRankCrossNet, Module, Sequential};
    let be = NativeBackend::new(1);
    let x = Tensor::from_vec(4, 6, (0..24).map(|i| (i as f64 * 0.37).sin()).collect()).unwrap();
    let dy = Tensor::from_vec(4, 1, vec![0.5, -1.0, 0.25, 2.0]).unwrap();
    let mut seq = Sequential::<f64>::new()
        .push("cross.", LowRankCrossNet::new(6, 2, 3, 5))
        .push("top.", Mlp::new(&[6, 5, 1], Activation::None, 6));
    let (mut cross, mut top) = (
        LowRankCrossNet::<f64>::new(6, 2, 3, 5),
        Mlp::<f64>::new(&[6, 5, 1], Activation::None, 6),
    );
    let y = seq.forward(&be, &x).data().to_vec();
    let dx = seq.backward(&be, &dy).data().to_vec();
    let h = cross.forward(&be, &x).clone();
    assert_eq!(top.forward(&be, &h).data(), &y[..]);
    let dh = top.backward(&be, &dy, true).unwrap().clone();
    assert_eq!(cross.backward(&be, &dh).data(), &dx[..]);
    let by_hand: Vec<(String, Vec<f64>)> = (cross
        .params()
        .into_iter()
        .map(|p| (format!("cross.{}", p.name), p.grad.to_vec())))
    .chain(
        top.params()
            .into_iter()
            .map(|p| (format!("top.{}", p.name), p.grad.to_vec())),
    )
    .collect();
    let chained: Vec<(String, Vec<f64>)> = seq
        .params()
        .into_iter()
        .map(|p| (p.name, p.grad.to_vec()))
        .collect();
    assert_eq!(chained, by_hand);
    let views: Vec<(String, Vec<usize>, Vec<f64>)> = seq
        .param_views()
        .into_iter()
        .map(|v| (v.name, v.shape, v.value.to_vec()))
        .collect();
    let params: Vec<(String, Vec<usize>, Vec<f64>)> = seq
        .params()
        .into_iter()
        .map(|p| (p.name, p.shape, p.value.to_vec()))
        .collect();
    assert_eq!(views, params);
}
