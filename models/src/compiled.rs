//! The `compiled` execution mode: the whole dense step of a DLRM (bottom
//! MLP, interaction, top MLP, loss, every gradient and the dense optimizer's
//! update) as one StableHLO program, one PJRT executable. Parameters and
//! optimizer state stay on the device between steps (each step's outputs are
//! the next one's inputs); only the batch goes in and only the loss and the
//! pooled embeddings' gradient come out.

use std::collections::BTreeMap;
use std::sync::Arc;

use ember_dense::pjrt::hlo::{ty, Func};
use ember_dense::pjrt::{lower, DeviceBuffer, Executable, PjrtBackend, PjrtError};
use ember_dense::{Activation, DenseOptimizerConfig, HasParams};

use crate::checkpoint::dense_shapes;
use crate::dlrm::{bottom_linear_prefix, top_linear_prefix};
use crate::{BatchError, Dlrm, DlrmConfig, InteractionType, ModelError};

fn pjrt(e: PjrtError) -> ModelError {
    ModelError::from(e)
}

/// One compiled dense step for a model, batch size and optimizer.
pub struct CompiledDenseStep {
    backend: Arc<PjrtBackend>,
    exe: Arc<Executable>,
    batch: usize,
    /// Parameter names in `DenseArch::params` order, and their shapes.
    names: Vec<(String, Vec<usize>)>,
    optimizer: DenseOptimizerConfig,
    params: Vec<DeviceBuffer>,
    /// Per parameter: Adam's `m, v`, Adagrad's `sum`, nothing for SGD.
    state: Vec<DeviceBuffer>,
    steps: u64,
    /// The host copy of the parameters is behind the device's.
    host_stale: bool,
}

impl CompiledDenseStep {
    /// Compiles the step of `model` for batches of `batch` and uploads its
    /// parameters and optimizer state.
    pub fn new(
        backend: Arc<PjrtBackend>,
        model: &mut Dlrm,
        batch: usize,
    ) -> Result<Self, ModelError> {
        let config = model.config().clone();
        let optimizer = model.dense_optimizer().config();
        let shapes = dense_shapes(&config);
        let names: Vec<(String, Vec<usize>)> = (model.dense_arch_mut().params().into_iter())
            .map(|p| {
                let shape = shapes[&p.name].clone();
                (p.name, shape)
            })
            .collect();
        let program = step_program(&config, &names, &optimizer, batch);
        let exe = backend.try_executable(&program).map_err(pjrt)?;
        let mut step = Self {
            backend,
            exe,
            batch,
            names,
            optimizer,
            params: Vec::new(),
            state: Vec::new(),
            steps: 0,
            host_stale: false,
        };
        step.upload(model)?;
        Ok(step)
    }

    fn upload(&mut self, model: &mut Dlrm) -> Result<(), ModelError> {
        let client = self.backend.client();
        let values: Vec<Vec<f32>> = (model.dense_arch_mut().params().into_iter())
            .map(|p| p.value.to_vec())
            .collect();
        self.params = (values.iter().zip(&self.names))
            .map(|(v, (_, shape))| client.buffer_f32(v, shape))
            .collect::<Result<_, _>>()
            .map_err(pjrt)?;
        let opt = model.dense_optimizer();
        self.steps = opt.steps();
        let saved: Vec<(Vec<f32>, Vec<f32>)> = opt
            .state()
            .map(|(_, _, m, v)| (m.to_vec(), v.to_vec()))
            .collect();
        self.state.clear();
        for (i, (_, shape)) in self.names.iter().enumerate() {
            let len: usize = shape.iter().product();
            let zeros = vec![0.0; len];
            let (m, v) = saved.get(i).map_or((&zeros, &zeros), |(m, v)| {
                (
                    if m.is_empty() { &zeros } else { m },
                    if v.is_empty() { &zeros } else { v },
                )
            });
            let parts: Vec<&Vec<f32>> = match self.optimizer.state_tensors() {
                0 => vec![],
                1 => vec![v],
                _ => vec![m, v],
            };
            for part in parts {
                self.state
                    .push(client.buffer_f32(part, shape).map_err(pjrt)?);
            }
        }
        self.host_stale = false;
        Ok(())
    }

    /// Sets the learning rate of the next steps (a schedule's): an
    /// argument of the step, so nothing is compiled again.
    pub fn set_learning_rate(&mut self, lr: f32) {
        self.optimizer = self.optimizer.with_learning_rate(lr);
    }

    /// The batch size it was compiled for; [`run`](Self::run) takes no other.
    pub fn batch_size(&self) -> usize {
        self.batch
    }

    /// One step: returns the loss and the pooled embeddings' gradient
    /// (`[batch, F * D]`), and leaves the updated parameters on the device.
    pub fn run(
        &mut self,
        dense: &[f32],
        pooled: &[f32],
        labels: &[f32],
    ) -> Result<(f32, Vec<f32>), ModelError> {
        let client = self.backend.client();
        let b = self.batch;
        if labels.len() != b {
            return Err(BatchError::CompiledSize {
                compiled: b,
                got: labels.len(),
            }
            .into());
        }
        let nd = dense.len() / b.max(1);
        let np = pooled.len() / b.max(1);
        // The step counts only once the step has run (a failed one can be retried).
        let (s1, s2) = step_scalars(&self.optimizer, self.steps + 1);
        let inputs = [
            client.buffer_f32(dense, &[b, nd]).map_err(pjrt)?,
            client.buffer_f32(pooled, &[b, np]).map_err(pjrt)?,
            client.buffer_f32(labels, &[b]).map_err(pjrt)?,
            client.buffer_f32(&[s1], &[]).map_err(pjrt)?,
            client.buffer_f32(&[s2], &[]).map_err(pjrt)?,
        ];
        let mut args: Vec<&DeviceBuffer> = inputs.iter().collect();
        args.extend(self.params.iter());
        args.extend(self.state.iter());
        let mut outs = self.exe.execute(&args).map_err(pjrt)?;
        let loss = outs[0].to_f32().map_err(pjrt)?[0];
        let d_pooled = outs[1].to_f32().map_err(pjrt)?;
        let k = self.params.len();
        self.state = outs.split_off(2 + k);
        self.params = outs.split_off(2);
        self.steps += 1;
        self.host_stale = true;
        Ok((loss, d_pooled))
    }

    /// Copies the device's parameters and optimizer state into `model`
    /// (before evaluating, predicting or checkpointing on the host).
    pub fn sync_to_host(&mut self, model: &mut Dlrm) -> Result<(), ModelError> {
        if !self.host_stale {
            return Ok(());
        }
        let values: Vec<Vec<f32>> = self
            .params
            .iter()
            .map(|b| b.to_f32())
            .collect::<Result<_, _>>()
            .map_err(pjrt)?;
        for (p, v) in model.dense_arch_mut().params().into_iter().zip(&values) {
            p.value.copy_from_slice(v);
        }
        let per = self.optimizer.state_tensors();
        let mut state = Vec::with_capacity(self.names.len());
        for (i, (name, shape)) in self.names.iter().enumerate() {
            let len = shape.iter().product();
            let get = |j: usize| self.state[i * per + j].to_f32().map_err(pjrt);
            let (m, v) = match per {
                0 => (vec![], vec![]),
                1 => (vec![], get(0)?),
                _ => (get(0)?, get(1)?),
            };
            state.push((name.clone(), len, m, v));
        }
        model.dense_optimizer_mut().set_state(self.steps, state);
        self.host_stale = false;
        Ok(())
    }
}

/// The per-step scalars of the update, as the native optimizer computes
/// them: Adam's `step_size` and `1 / sqrt(1 - b2^t)`; for SGD and Adagrad
/// the learning rate (a schedule changes it between steps) and nothing.
fn step_scalars(o: &DenseOptimizerConfig, t: u64) -> (f32, f32) {
    match o.adam_bias_correction(t) {
        Some((s1, s2)) => (s1 as f32, s2 as f32),
        None => (o.learning_rate(), 0.0),
    }
}

/// A scalar argument spread over `shape`.
fn broadcast(f: &mut Func, scalar: &str, shape: &[usize]) -> String {
    f.op(format!(
        "stablehlo.broadcast_in_dim {scalar}, dims = [] : ({}) -> {}",
        ty(&[]),
        ty(shape)
    ))
}

/// The StableHLO of one training step. Arguments: dense `[B, nd]`, pooled
/// `[B, F D]`, labels `[B]`, two optimizer scalars, the parameters, the
/// optimizer state. Results: loss, d(pooled), the new parameters, the new state.
fn step_program(
    c: &DlrmConfig,
    names: &[(String, Vec<usize>)],
    o: &DenseOptimizerConfig,
    b: usize,
) -> String {
    let mut f = Func::new();
    let (nd, d, nf) = (c.num_dense(), c.embedding_dim(), c.num_sparse_features());
    let dense = f.arg(&[b, nd]);
    let pooled = f.arg(&[b, nf * d]);
    let labels = f.arg(&[b]);
    let s1 = f.arg(&[]);
    let s2 = f.arg(&[]);
    let mut p: BTreeMap<&str, String> = BTreeMap::new();
    for (name, shape) in names {
        let v = f.arg(shape);
        p.insert(name.as_str(), v);
    }
    let per = o.state_tensors();
    let state: Vec<Vec<String>> = names
        .iter()
        .map(|(_, shape)| (0..per).map(|_| f.arg(shape)).collect())
        .collect();
    let mut grads: BTreeMap<String, String> = BTreeMap::new();

    // Bottom MLP (ReLU after every layer, TorchRec's DenseArch).
    let bottom: Vec<Layer> = (c.bottom_mlp.windows(2).enumerate())
        .map(|(i, w)| Layer {
            prefix: bottom_linear_prefix(i),
            inp: w[0],
            out: w[1],
            act: Activation::Relu,
        })
        .collect();
    let xs = mlp_forward(&mut f, &p, &bottom, &dense, b);
    let bottom_out = xs.last().expect("a bottom layer").clone();

    // Interaction.
    let width = (nf + 1) * d;
    let (top_in, mut dcn) = match c.interaction {
        InteractionType::Dot => (
            lower::dot_interaction_forward(&mut f, &bottom_out, &pooled, b, nf, d),
            None,
        ),
        InteractionType::Dcn { layers, rank } => {
            let x0 = lower::concat_columns(&mut f, &bottom_out, &pooled, b, d, nf * d);
            let mut xl = vec![x0.clone()];
            let mut vs = Vec::new();
            let mut hs = Vec::new();
            for l in 0..layers {
                let w = &p[format!("inter_arch.crossnet.W_kernels.{l}").as_str()];
                let v = &p[format!("inter_arch.crossnet.V_kernels.{l}").as_str()];
                let bias = &p[format!("inter_arch.crossnet.bias.{l}").as_str()];
                let (vx, _) = f.dot(&xl[l], &[b, width], 1, v, &[rank, width], 1);
                let (h, _) = f.dot(&vx, &[b, rank], 1, w, &[width, rank], 1);
                let next = lower::cross_combine_forward(&mut f, &x0, &h, bias, &xl[l], b, width);
                vs.push(vx);
                hs.push(h);
                xl.push(next);
            }
            (xl[layers].clone(), Some((xl, vs, hs, layers, rank)))
        }
    };

    // Top MLP (no activation on the logit; TorchRec's OverArch).
    let top_sizes = c.top_mlp_sizes();
    let nt = top_sizes.len() - 1;
    let top: Vec<Layer> = (top_sizes.windows(2).enumerate())
        .map(|(i, w)| Layer {
            prefix: top_linear_prefix(i, nt),
            inp: w[0],
            out: w[1],
            act: if i + 1 == nt {
                Activation::None
            } else {
                Activation::Relu
            },
        })
        .collect();
    let ts = mlp_forward(&mut f, &p, &top, &top_in, b);
    let logits = f.reshape(ts.last().expect("a top layer"), &[b, 1], &[b]);
    let (loss, dlogits) = lower::bce_with_logits(&mut f, &logits, &labels, b);

    // Backward: top.
    let d_logits = f.reshape(&dlogits, &[b], &[b, 1]);
    let mut g = mlp_backward(&mut f, &p, &top, &ts, d_logits, b, true, &mut grads);
    // Interaction.
    let (d_bottom, d_pooled) = match dcn.take() {
        None => lower::dot_interaction_backward(&mut f, &bottom_out, &pooled, &g, b, nf, d),
        Some((xl, vs, hs, layers, rank)) => {
            let x0 = xl[0].clone();
            let mut dx0 = f.splat(0.0, &[b, width]);
            for l in (0..layers).rev() {
                let w = &p[format!("inter_arch.crossnet.W_kernels.{l}").as_str()];
                let v = &p[format!("inter_arch.crossnet.V_kernels.{l}").as_str()];
                let bias = &p[format!("inter_arch.crossnet.bias.{l}").as_str()];
                let (dh, db, ndx0) =
                    lower::cross_combine_backward(&mut f, &x0, &hs[l], bias, &g, &dx0, b, width);
                dx0 = ndx0;
                let (dw, _) = f.dot(&dh, &[b, width], 0, &vs[l], &[b, rank], 0);
                let (dv, _) = f.dot(&dh, &[b, width], 1, w, &[width, rank], 0);
                let (dvk, _) = f.dot(&dv, &[b, rank], 0, &xl[l], &[b, width], 0);
                let (back, _) = f.dot(&dv, &[b, rank], 1, v, &[rank, width], 0);
                g = f.binary("add", &back, &g, &[b, width]);
                grads.insert(format!("inter_arch.crossnet.W_kernels.{l}"), dw);
                grads.insert(format!("inter_arch.crossnet.V_kernels.{l}"), dvk);
                grads.insert(format!("inter_arch.crossnet.bias.{l}"), db);
            }
            let total = f.binary("add", &dx0, &g, &[b, width]);
            (
                lower::slice_columns(&mut f, &total, b, width, 0, d),
                lower::slice_columns(&mut f, &total, b, width, d, width),
            )
        }
    };
    // Bottom (no input gradient: the dense features are data).
    mlp_backward(&mut f, &p, &bottom, &xs, d_bottom, b, false, &mut grads);

    // The optimizer, as the native one computes it.
    let mut results = vec![(loss, vec![]), (d_pooled, vec![b, nf * d])];
    let mut new_state = Vec::new();
    for ((name, shape), st) in names.iter().zip(&state) {
        let w = &p[name.as_str()];
        let gr = &grads[name];
        let (new_w, state) = optimizer_update(&mut f, o, (w, gr, st), shape, (&s1, &s2));
        new_state.extend(state);
        results.push((new_w, shape.clone()));
    }
    results.extend(new_state);
    f.finish(&results)
}

/// The update of one parameter `w` with gradient `gr` and optimizer state
/// `st` (of `shape`), as the native optimizer computes it: the new value
/// and the new state. `s1`, `s2`: Adam's step size and inverse bias
/// correction, arguments of the step.
fn optimizer_update(
    f: &mut Func,
    o: &DenseOptimizerConfig,
    (w, gr, st): (&str, &str, &[String]),
    shape: &[usize],
    (s1, s2): (&str, &str),
) -> (String, Vec<(String, Vec<usize>)>) {
    let mut new_state = Vec::new();
    let new_w = match *o {
        DenseOptimizerConfig::Sgd { .. } => {
            let lr = broadcast(f, s1, shape);
            let step = f.binary("multiply", &lr, gr, shape);
            f.binary("subtract", w, &step, shape)
        }
        DenseOptimizerConfig::Adagrad { eps, .. } => {
            let g2 = f.binary("multiply", gr, gr, shape);
            let s = f.binary("add", &st[0], &g2, shape);
            let root = f.op(format!("stablehlo.sqrt {s} : {}", ty(shape)));
            let e = f.splat(eps, shape);
            let den = f.binary("add", &root, &e, shape);
            let lr = broadcast(f, s1, shape);
            let num = f.binary("multiply", &lr, gr, shape);
            let step = f.binary("divide", &num, &den, shape);
            new_state.push((s, shape.to_vec()));
            f.binary("subtract", w, &step, shape)
        }
        DenseOptimizerConfig::Adam {
            beta1, beta2, eps, ..
        } => {
            let (b1, ob1) = (f.splat(beta1, shape), f.splat(1.0 - beta1, shape));
            let (b2, ob2) = (f.splat(beta2, shape), f.splat(1.0 - beta2, shape));
            let m1 = f.binary("multiply", &b1, &st[0], shape);
            let m2 = f.binary("multiply", &ob1, gr, shape);
            let m = f.binary("add", &m1, &m2, shape);
            let v1 = f.binary("multiply", &b2, &st[1], shape);
            let g2 = f.binary("multiply", gr, gr, shape);
            let v2 = f.binary("multiply", &ob2, &g2, shape);
            let v = f.binary("add", &v1, &v2, shape);
            let step_size = broadcast(f, s1, shape);
            let inv_bc2 = broadcast(f, s2, shape);
            let root = f.op(format!("stablehlo.sqrt {v} : {}", ty(shape)));
            let scaled = f.binary("multiply", &root, &inv_bc2, shape);
            let e = f.splat(eps, shape);
            let den = f.binary("add", &scaled, &e, shape);
            let num = f.binary("multiply", &step_size, &m, shape);
            let step = f.binary("divide", &num, &den, shape);
            new_state.push((m, shape.to_vec()));
            new_state.push((v, shape.to_vec()));
            f.binary("subtract", w, &step, shape)
        }
    };
    (new_w, new_state)
}

/// One linear layer of an MLP: its parameter prefix, sizes and activation.
struct Layer {
    prefix: String,
    inp: usize,
    out: usize,
    act: Activation,
}

/// The input and each layer's output.
fn mlp_forward(
    f: &mut Func,
    p: &BTreeMap<&str, String>,
    layers: &[Layer],
    x: &str,
    b: usize,
) -> Vec<String> {
    let mut xs = vec![x.to_string()];
    for (i, l) in layers.iter().enumerate() {
        let (w, bias) = (
            &p[format!("{}weight", l.prefix).as_str()],
            &p[format!("{}bias", l.prefix).as_str()],
        );
        let y = lower::linear_forward(f, &xs[i], w, bias, b, l.inp, l.out, l.act);
        xs.push(y);
    }
    xs
}

/// Back through the layers from `g` (the gradient of the last output),
/// recording each parameter's gradient; returns the input's gradient, or
/// `g` unchanged past the first layer when `want_dx` is false.
#[allow(clippy::too_many_arguments)]
fn mlp_backward(
    f: &mut Func,
    p: &BTreeMap<&str, String>,
    layers: &[Layer],
    xs: &[String],
    mut g: String,
    b: usize,
    want_dx: bool,
    grads: &mut BTreeMap<String, String>,
) -> String {
    for (i, l) in layers.iter().enumerate().rev() {
        let w = &p[format!("{}weight", l.prefix).as_str()];
        let need_dx = want_dx || i > 0;
        let (_, dw, db, dx) = lower::linear_backward(
            f,
            &xs[i],
            w,
            &xs[i + 1],
            &g,
            b,
            l.inp,
            l.out,
            l.act,
            need_dx,
        );
        grads.insert(format!("{}weight", l.prefix), dw);
        grads.insert(format!("{}bias", l.prefix), db);
        if let Some(dx) = dx {
            g = dx;
        }
    }
    g
}
