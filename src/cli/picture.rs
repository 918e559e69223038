//! Pictures: plotters draws SVG, resvg rasterises it with the machine's
//! fonts, and the PNG is written whole (temp file, rename).

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context};

use ember_dataloader::atomic::AtomicFile;

/// Writes `svg` to `path` as a PNG.
pub fn write_png(svg: &str, path: &Path) -> anyhow::Result<()> {
    let png = rasterise(svg)?;
    let mut file = AtomicFile::create(path)?;
    (file.file().write_all(&png)).with_context(|| format!("writing {}", path.display()))?;
    file.commit()?;
    Ok(())
}

/// Draws `chart`'s series legend at `position`, in the one style every
/// picture uses.
pub fn legend<'a, 'b: 'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut plotters::chart::ChartContext<'a, plotters::prelude::SVGBackend<'b>, CT>,
    position: plotters::chart::SeriesLabelPosition,
) -> anyhow::Result<()> {
    use plotters::prelude::*;
    chart
        .configure_series_labels()
        .position(position)
        .label_font(("sans-serif", 14))
        .border_style(BLACK)
        .background_style(WHITE.mix(0.9))
        .draw()?;
    Ok(())
}

/// The SVG as PNG bytes, its text in the first of the usual sans-serif
/// families the machine has.
fn rasterise(svg: &str) -> anyhow::Result<Vec<u8>> {
    use resvg::{tiny_skia, usvg};
    let mut options = usvg::Options::default();
    let fonts = options.fontdb_mut();
    fonts.load_system_fonts();
    let families = [
        "DejaVu Sans",
        "Liberation Sans",
        "Arial",
        "Helvetica",
        "Noto Sans",
    ];
    let family = families.into_iter().find(|f| {
        fonts
            .faces()
            .any(|face| face.families.iter().any(|(name, _)| name == f))
    });
    match family {
        Some(f) => fonts.set_sans_serif_family(f),
        None => bail!(
            "no font for the plot's text (looked for {}): install one \
             (Debian/Ubuntu: apt install fonts-dejavu-core)",
            families.join(", ")
        ),
    }
    let tree = usvg::Tree::from_str(svg, &options).context("the plot's SVG")?;
    let size = tree.size().to_int_size();
    let mut pixmap =
        tiny_skia::Pixmap::new(size.width(), size.height()).context("a picture of no pixels")?;
    resvg::render(&tree, tiny_skia::Transform::default(), &mut pixmap.as_mut());
    pixmap.encode_png().context("encoding the PNG")
}
