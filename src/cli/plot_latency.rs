//! `ember plot-latency`: latency percentiles against offered load, from
//! the JSON `scripts/serve_loadtest.py` writes (one file a series: fp32,
//! int8, the empty model...), as a PNG. Drawn as SVG by plotters, then
//! rasterised by resvg with the machine's fonts.

use std::path::PathBuf;

use anyhow::bail;
use clap::Args;
use serde::Serialize;

use super::load_test::{read, LoadTest, Rate};

#[derive(Args, Clone, Debug)]
pub struct PlotLatencyArgs {
    /// Load tests' JSON (scripts/serve_loadtest.py --output), one series each.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// The PNG written.
    #[arg(long)]
    pub output: PathBuf,
    /// The picture's title.
    #[arg(long, default_value = "ember serve: latency against offered load")]
    pub title: String,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// A percentile's name, its value in a rate's figures, its line width.
type Percentile = (&'static str, fn(&Rate) -> f64, u32);

#[derive(Debug, Serialize)]
pub struct PlotReport {
    pub event: &'static str,
    pub output: PathBuf,
    pub series: Vec<String>,
}

impl std::fmt::Display for PlotReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let series = self.series.join(", ");
        write!(f, "{} written ({series})", self.output.display())
    }
}

pub fn run(args: &PlotLatencyArgs) -> anyhow::Result<PlotReport> {
    let mut tests = Vec::new();
    for path in &args.inputs {
        let test = read(path)?;
        if test.rates.is_empty() {
            bail!("{}: no rates in it", path.display());
        }
        let label = match test.label.is_empty() {
            true => path
                .file_stem()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned(),
            false => test.label.clone(),
        };
        tests.push((label, test));
    }
    super::picture::write_png(&chart(&args.title, &tests)?, &args.output)?;
    Ok(PlotReport {
        event: "plot",
        output: args.output.clone(),
        series: tests.into_iter().map(|(label, _)| label).collect(),
    })
}

/// p50, p99 and p99.9 of each test against its offered samples/s, on a
/// logarithmic latency axis, with the p99 bound drawn across.
fn chart(title: &str, tests: &[(String, LoadTest)]) -> anyhow::Result<String> {
    use plotters::prelude::*;
    let rates = || tests.iter().flat_map(|(_, t)| &t.rates);
    let x_max = rates().fold(0f64, |a, r| a.max(r.target_samples_per_s)) * 1.05;
    let bound = tests[0].1.target_latency_ms;
    let y_max = rates().fold(bound, |a, r| a.max(r.p999_ms)) * 2.0;
    let y_min = rates()
        .fold(f64::INFINITY, |a, r| a.min(r.p50_ms))
        .max(1e-3)
        / 2.0;
    let colors = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(50)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..x_max.max(1.0), (y_min..y_max).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("offered load (samples/s, Poisson arrivals)")
            .y_desc("latency (ms, log scale)")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y}"))
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 17))
            .draw()?;
        chart
            .draw_series(DashedLineSeries::new(
                [(0.0, bound), (x_max, bound)],
                10,
                6,
                BLACK.stroke_width(2),
            ))?
            .label(format!("p99 bound, {bound} ms"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], BLACK.stroke_width(2)));
        for (i, (label, test)) in tests.iter().enumerate() {
            let color = colors[i % colors.len()];
            let percentiles: [Percentile; 3] = [
                ("p50", |r| r.p50_ms, 1),
                ("p99", |r| r.p99_ms, 3),
                ("p99.9", |r| r.p999_ms, 1),
            ];
            for (name, value, width) in percentiles {
                let points: Vec<(f64, f64)> = (test.rates.iter())
                    .map(|r| (r.target_samples_per_s, value(r)))
                    .collect();
                let style = color.stroke_width(width);
                let series = match name {
                    "p99.9" => {
                        chart.draw_series(DashedLineSeries::new(points.clone(), 6, 4, style))?
                    }
                    _ => chart.draw_series(LineSeries::new(points.clone(), style))?,
                };
                series
                    .label(format!("{label} {name}"))
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(width))
                    });
                chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
            }
        }
        super::picture::legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
        root.present()?;
    }
    Ok(svg)
}
