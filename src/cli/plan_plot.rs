//! `ember plan --plot`: the plan's per-device load as a PNG: the bytes
//! each device stores against its memory (and on the disk tier), and each
//! device's estimated time per step against the most loaded one's.

use std::path::Path;

use ember_sharding::PlanStats;

/// Draws `stats` into `path`.
pub fn write(stats: &PlanStats, title: &str, path: &Path) -> anyhow::Result<()> {
    super::picture::write_png(&chart(stats, title)?, path)
}

fn chart(stats: &PlanStats, title: &str) -> anyhow::Result<String> {
    use plotters::prelude::*;
    let largest = (stats.devices.iter())
        .map(|d| d.storage_bytes.max(d.memory_bytes).max(d.disk_bytes))
        .max()
        .unwrap_or(0);
    // GiB, or MiB for plans under a GiB a device.
    let (unit, per) = match largest >= 1 << 30 {
        true => ("GiB", (1u64 << 30) as f64),
        false => ("MiB", (1u64 << 20) as f64),
    };
    let gib = |b: u64| b as f64 / per;
    let devices = stats.devices.len().max(1);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 760)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(title, ("sans-serif", 22))?;
        let (top, bottom) = root.split_vertically(380);

        // Memory: stored bytes (and disk-tier bytes) beside each device's capacity.
        // Headroom above the tallest for the legend.
        let most = gib(largest).max(1e-3) * 1.5;
        let mut chart = panel(&top, devices, most, unit)?;
        let bar = |d: usize, from: f64, to: f64, value: f64, color: RGBColor| {
            Rectangle::new(
                [(d as f64 + from, 0.0), (d as f64 + to, value)],
                color.filled(),
            )
        };
        let blue = RGBColor(66, 114, 196);
        let orange = RGBColor(237, 125, 49);
        chart
            .draw_series(
                (stats.devices.iter().enumerate())
                    .map(|(d, l)| bar(d, -0.35, 0.0, gib(l.storage_bytes), blue)),
            )?
            .label("stored in memory (weights, optimizer state, outputs)")
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], blue.filled()));
        chart
            .draw_series(
                (stats.devices.iter().enumerate())
                    .map(|(d, l)| bar(d, 0.0, 0.35, gib(l.disk_bytes), orange)),
            )?
            .label("on the disk tier")
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], orange.filled()));
        chart
            .draw_series((stats.devices.iter().enumerate()).map(|(d, l)| {
                let m = gib(l.memory_bytes);
                PathElement::new(
                    vec![(d as f64 - 0.45, m), (d as f64 + 0.45, m)],
                    BLACK.stroke_width(3),
                )
            }))?
            .label("device memory")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], BLACK.stroke_width(3)));
        super::picture::legend(&mut chart, SeriesLabelPosition::UpperRight)?;

        // Time: each device's estimated ms per step.
        let ms = |s: f64| s * 1e3;
        let top_ms = ms(stats.max_cost_s).max(1e-6) * 1.3;
        let mut chart = panel(&bottom, devices, top_ms, "estimated ms per step")?;
        chart
            .draw_series(
                (stats.devices.iter().enumerate())
                    .map(|(d, l)| bar(d, -0.3, 0.3, ms(l.cost_s), blue)),
            )?
            .label("lookups and exchanges (the planner's estimate)")
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], blue.filled()));
        super::picture::legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        root.present()?;
    }
    Ok(svg)
}

type Chart<'a, 'b> = plotters::chart::ChartContext<
    'a,
    plotters::backend::SVGBackend<'b>,
    plotters::coord::cartesian::Cartesian2d<
        plotters::coord::types::RangedCoordf64,
        plotters::coord::types::RangedCoordf64,
    >,
>;

/// A panel of one bar slot a device, `0..y_max` up, its axes drawn.
fn panel<'a, 'b>(
    area: &'a plotters::drawing::DrawingArea<
        plotters::backend::SVGBackend<'b>,
        plotters::coord::Shift,
    >,
    devices: usize,
    y_max: f64,
    y_desc: &str,
) -> anyhow::Result<Chart<'a, 'b>> {
    use plotters::prelude::*;
    let mut chart = ChartBuilder::on(area)
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.5f64..devices as f64 - 0.5, 0f64..y_max)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(devices.min(32))
        .x_label_formatter(&|x| format!("{}", x.round() as i64))
        .x_desc("device")
        .y_desc(y_desc)
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 16))
        .draw()?;
    Ok(chart)
}
