//! `ember plot`: training runs' JSON-lines logs (`ember train --json`, or
//! the library's `TrainEvent`s serialised) as a PNG of their loss, AUC and
//! NE against the step, one colour a run, overlaid.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use serde::Serialize;

#[derive(Args, Clone, Debug)]
pub struct PlotArgs {
    /// JSON-lines logs of runs (`ember train --json > run.jsonl`), one
    /// series each.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// The PNG written.
    #[arg(long)]
    pub output: PathBuf,
    /// Each input's name in the legend, in order (default: the file's name).
    #[arg(long = "label")]
    pub labels: Vec<String>,
    /// The picture's title.
    #[arg(long, default_value = "ember train")]
    pub title: String,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
pub struct PlotReport {
    pub event: &'static str,
    pub output: PathBuf,
    /// Each run's label, with its logged losses and evaluations.
    pub series: Vec<SeriesReport>,
}

#[derive(Debug, Serialize)]
pub struct SeriesReport {
    pub label: String,
    pub losses: usize,
    pub evaluations: usize,
}

impl std::fmt::Display for PlotReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let series: Vec<String> = (self.series.iter())
            .map(|s| {
                format!(
                    "{}: {} losses, {} evaluations",
                    s.label, s.losses, s.evaluations
                )
            })
            .collect();
        write!(
            f,
            "{} written ({})",
            self.output.display(),
            series.join("; ")
        )
    }
}

/// One run's curves: (step, value) pairs.
#[derive(Default)]
struct Run {
    label: String,
    loss: Vec<(f64, f64)>,
    auc: Vec<(f64, f64)>,
    ne: Vec<(f64, f64)>,
}

pub fn run(args: &PlotArgs) -> anyhow::Result<PlotReport> {
    if args.labels.len() > args.inputs.len() {
        bail!(
            "{} --label for {} inputs: at most one label an input",
            args.labels.len(),
            args.inputs.len()
        );
    }
    let mut runs = Vec::new();
    for (i, path) in args.inputs.iter().enumerate() {
        let label = match args.labels.get(i) {
            Some(l) => l.clone(),
            None => (path.file_stem().unwrap_or_default().to_string_lossy()).into_owned(),
        };
        runs.push(read(path, label)?);
    }
    super::picture::write_png(&chart(&args.title, &runs)?, &args.output)?;
    Ok(PlotReport {
        event: "plot",
        output: args.output.clone(),
        series: (runs.iter())
            .map(|r| SeriesReport {
                label: r.label.clone(),
                losses: r.loss.len(),
                evaluations: r.auc.len(),
            })
            .collect(),
    })
}

/// A log's `train` (mean loss since the last) and `eval` lines; other
/// events are passed over, a line that is not JSON is named.
fn read(path: &Path, label: String) -> anyhow::Result<Run> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut run = Run {
        label,
        ..Run::default()
    };
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let at = || format!("{} line {}", path.display(), n + 1);
        let event: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{}: not a JSON line", at()))?;
        let number = |key: &str| event[key].as_f64();
        let step = number("steps");
        match (event["event"].as_str(), step) {
            (Some("train"), Some(step)) => {
                // A NaN loss is null in JSON: left out, as NaN metrics are.
                if let Some(loss) = number("loss") {
                    run.loss.push((step, loss));
                }
            }
            (Some("eval"), Some(step)) => {
                // NaN metrics (one class) are null in JSON: left out.
                if let Some(auc) = number("auc") {
                    run.auc.push((step, auc));
                }
                if let Some(ne) = number("ne") {
                    run.ne.push((step, ne));
                }
            }
            _ => {}
        }
    }
    if run.loss.is_empty() && run.auc.is_empty() {
        bail!(
            "{}: no `train` or `eval` events (write it with `ember train --json`)",
            path.display()
        );
    }
    Ok(run)
}

/// Three panels over the same steps: training loss, evaluation AUC and NE.
fn chart(title: &str, runs: &[Run]) -> anyhow::Result<String> {
    use plotters::prelude::*;
    type Curve = fn(&Run) -> &[(f64, f64)];
    // The legend where the curves are not: loss and NE fall, AUC rises.
    let panels: [(&str, Curve, SeriesLabelPosition); 3] = [
        (
            "training loss (mean since the last log)",
            |r| &r.loss,
            SeriesLabelPosition::UpperRight,
        ),
        (
            "evaluation AUC",
            |r| &r.auc,
            SeriesLabelPosition::LowerRight,
        ),
        (
            "evaluation NE (normalized entropy)",
            |r| &r.ne,
            SeriesLabelPosition::UpperRight,
        ),
    ];
    let all = |curve: Curve| runs.iter().flat_map(move |r| curve(r).iter());
    let x_max = (panels.iter())
        .flat_map(|(_, c, _)| all(*c).map(|p| p.0))
        .fold(1.0f64, f64::max);
    let colors = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 1000)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(title, ("sans-serif", 24))?;
        for (area, (name, curve, legend)) in root.split_evenly((3, 1)).iter().zip(panels) {
            let (lo, hi) = all(curve).fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
                (lo.min(p.1), hi.max(p.1))
            });
            let (lo, hi) = match lo.is_finite() {
                true => {
                    let pad = ((hi - lo) * 0.08).max(hi.abs().max(1.0) * 1e-3);
                    (lo - pad, hi + pad)
                }
                false => (0.0, 1.0),
            };
            let mut chart = ChartBuilder::on(area)
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(70)
                .build_cartesian_2d(0f64..x_max * 1.02, lo..hi)?;
            chart
                .configure_mesh()
                .x_desc("step")
                .y_desc(name)
                .x_label_formatter(&|x| format!("{x:.0}"))
                .y_label_formatter(&|y| format!("{y:.3}"))
                .label_style(("sans-serif", 14))
                .axis_desc_style(("sans-serif", 16))
                .draw()?;
            for (i, run) in runs.iter().enumerate() {
                let color = colors[i % colors.len()];
                let points = curve(run).to_vec();
                chart
                    .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
                    .label(&run.label)
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(2))
                    });
                if points.len() < 60 {
                    chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
                }
            }
            super::picture::legend(&mut chart, legend)?;
        }
        root.present()?;
    }
    Ok(svg)
}
