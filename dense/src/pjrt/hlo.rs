//! StableHLO text for the dense ops, one small function per op and shape.
//! Every program is a `@main` over f32 tensors; the text is also the key of
//! the executable cache.

use std::fmt::Write;

use crate::backend::Activation;

/// `tensor<RxCxf32>`, or `tensor<f32>` for a scalar (`dims` empty).
pub fn ty(dims: &[usize]) -> String {
    format!("tensor<{}f32>", shape_prefix(dims))
}

/// An f32 literal MLIR reads back exactly: 9 significant digits, and the
/// decimal point MLIR's float syntax requires.
fn lit(x: f32) -> String {
    format!("{x:.8e}")
}

/// A function body under construction.
#[derive(Default)]
pub struct Func {
    args: Vec<(String, String)>,
    body: String,
    next: usize,
}

impl Func {
    /// An empty function: no arguments, no body.
    pub fn new() -> Self {
        Self::default()
    }

    /// Declares the next argument, `%argN` of type `tensor<dims x f32>`, and returns its name.
    pub fn arg(&mut self, dims: &[usize]) -> String {
        let name = format!("%arg{}", self.args.len());
        self.args.push((name.clone(), ty(dims)));
        name
    }

    /// Appends `%vN = <op>` and returns `%vN`.
    pub fn op(&mut self, text: String) -> String {
        let name = format!("%v{}", self.next);
        self.next += 1;
        let _ = writeln!(self.body, "    {name} = {text}");
        name
    }

    /// A constant of shape `dims` with every element `x`; returns its name.
    pub fn splat(&mut self, x: f32, dims: &[usize]) -> String {
        self.op(format!(
            "stablehlo.constant dense<{}> : {}",
            lit(x),
            ty(dims)
        ))
    }

    /// The elementwise `stablehlo.<op>` (e.g. `add`, `multiply`) of `a` and `b`, both of shape
    /// `dims`; returns the result's name.
    pub fn binary(&mut self, op: &str, a: &str, b: &str, dims: &[usize]) -> String {
        self.op(format!("stablehlo.{op} {a}, {b} : {}", ty(dims)))
    }

    /// `a[m,k]·b[k,n]` with `ca`/`cb` the contracting dims of 2-D operands.
    pub fn dot(
        &mut self,
        a: &str,
        ad: &[usize],
        ca: usize,
        b: &str,
        bd: &[usize],
        cb: usize,
    ) -> (String, Vec<usize>) {
        let out = vec![ad[1 - ca], bd[1 - cb]];
        let v = self.op(format!(
            "stablehlo.dot_general {a}, {b}, contracting_dims = [{ca}] x [{cb}], precision = [HIGHEST, HIGHEST] : ({}, {}) -> {}",
            ty(ad),
            ty(bd),
            ty(&out)
        ));
        (v, out)
    }

    /// A row vector `[c]` broadcast to `[r, c]`.
    pub fn broadcast_row(&mut self, v: &str, r: usize, c: usize) -> String {
        self.op(format!(
            "stablehlo.broadcast_in_dim {v}, dims = [1] : ({}) -> {}",
            ty(&[c]),
            ty(&[r, c])
        ))
    }

    /// Sum over rows: `[r, c]` → `[c]`.
    pub fn sum_rows(&mut self, v: &str, r: usize, c: usize) -> String {
        self.sum_dim0(v, &[r, c], &[c])
    }

    /// Sum of everything: `[n]` → scalar.
    pub fn sum_all(&mut self, v: &str, n: usize) -> String {
        self.sum_dim0(v, &[n], &[])
    }

    /// Sum over the first dimension: `from` → `to`.
    fn sum_dim0(&mut self, v: &str, from: &[usize], to: &[usize]) -> String {
        let zero = self.splat(0.0, &[]);
        self.op(format!(
            "stablehlo.reduce({v} init: {zero}) applies stablehlo.add across dimensions = [0] : ({}, {}) -> {}",
            ty(from),
            ty(&[]),
            ty(to)
        ))
    }

    /// `v` reshaped from `from` to `to` (same number of elements, row-major order kept).
    pub fn reshape(&mut self, v: &str, from: &[usize], to: &[usize]) -> String {
        self.op(format!(
            "stablehlo.reshape {v} : ({}) -> {}",
            ty(from),
            ty(to)
        ))
    }

    /// Applies `act` to `z` (shape `dims`).
    pub fn activate(&mut self, z: &str, act: Activation, dims: &[usize]) -> String {
        match act {
            Activation::None => z.to_string(),
            Activation::Relu => {
                // `select(z < 0, 0, z)`, so a NaN propagates as in the native backend.
                let zero = self.splat(0.0, dims);
                let neg = self.op(format!(
                    "stablehlo.compare LT, {z}, {zero} : ({t}, {t}) -> tensor<{}i1>",
                    shape_prefix(dims),
                    t = ty(dims)
                ));
                self.op(format!(
                    "stablehlo.select {neg}, {zero}, {z} : tensor<{}i1>, {t}",
                    shape_prefix(dims),
                    t = ty(dims)
                ))
            }
            Activation::Sigmoid => self.op(format!("stablehlo.logistic {z} : {}", ty(dims))),
        }
    }

    /// The module text returning `results` (name, dims).
    pub fn finish(self, results: &[(String, Vec<usize>)]) -> String {
        let args: Vec<String> = self.args.iter().map(|(n, t)| format!("{n}: {t}")).collect();
        let types: Vec<String> = results.iter().map(|(_, d)| ty(d)).collect();
        let names: Vec<&str> = results.iter().map(|(n, _)| n.as_str()).collect();
        format!(
            "module @ember {{\n  func.func public @main({}) -> ({}) {{\n{}    return {} : {}\n  }}\n}}\n",
            args.join(", "),
            types.join(", "),
            self.body,
            names.join(", "),
            types.join(", ")
        )
    }
}

/// `RxC` of a shape followed by `x`, for element types other than f32.
fn shape_prefix(dims: &[usize]) -> String {
    dims.iter().map(|d| format!("{d}x")).collect()
}

/// `[[i], [j], ...]` as an `MxN x1xi32` constant.
fn index_constant(f: &mut Func, idx: &[usize]) -> String {
    let items: Vec<String> = idx.iter().map(|i| format!("[{i}]")).collect();
    f.op(format!(
        "stablehlo.constant dense<[{}]> : tensor<{}x1xi32>",
        items.join(", "),
        idx.len()
    ))
}

/// Columns `idx` of `v` (`[n, k]`) → `[n, idx.len()]`.
pub fn gather_columns(f: &mut Func, v: &str, n: usize, k: usize, idx: &[usize]) -> String {
    if idx.is_empty() {
        // No columns: MLIR has no literal for an empty index list.
        return f.splat(0.0, &[n, 0]);
    }
    let i = index_constant(f, idx);
    f.op(format!(
        "\"stablehlo.gather\"({v}, {i}) {{dimension_numbers = #stablehlo.gather<offset_dims = [0], collapsed_slice_dims = [1], start_index_map = [1], index_vector_dim = 1>, slice_sizes = array<i64: {n}, 1>, indices_are_sorted = false}} : ({}, tensor<{}x1xi32>) -> {}",
        ty(&[n, k]),
        idx.len(),
        ty(&[n, idx.len()])
    ))
}
