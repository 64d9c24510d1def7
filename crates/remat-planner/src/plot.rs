//! Memory-timeline charts: step lines over time plus a horizontal budget line, as SVG (with
//! text) or PNG (drawn into an RGB buffer here, with a built-in 3x5 pixel font, and encoded
//! by the `png` crate).

use std::fmt::Write as _;

/// One step line: memory holds each value until the next point.
#[derive(Clone, Debug)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    pub color: [u8; 3],
}

impl Series {
    pub fn new(label: &str, points: Vec<(f64, f64)>, color: [u8; 3]) -> Series {
        Series {
            label: label.to_string(),
            points,
            color,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    /// (label, y, color) of a horizontal line, e.g. the budget.
    pub hline: Option<(String, f64, [u8; 3])>,
}

/// Errors while encoding a PNG.
#[derive(Debug, thiserror::Error)]
#[error("cannot encode the PNG: {0}")]
pub struct PlotError(String);

const MARGIN_LEFT: f64 = 90.0;
const MARGIN_RIGHT: f64 = 20.0;
const MARGIN_TOP: f64 = 40.0;
const MARGIN_BOTTOM: f64 = 50.0;
const TICKS: usize = 5;

/// Maps data to pixels.
struct Frame {
    width: f64,
    height: f64,
    x_max: f64,
    y_max: f64,
}

impl Frame {
    fn new(chart: &Chart, width: f64, height: f64) -> Frame {
        let points = chart.series.iter().flat_map(|s| s.points.iter());
        let x_max = points.clone().map(|p| p.0).fold(0.0, f64::max);
        let mut y_max = points.map(|p| p.1).fold(0.0, f64::max);
        if let Some((_, y, _)) = &chart.hline {
            y_max = y_max.max(*y);
        }
        Frame {
            width,
            height,
            x_max: if x_max > 0.0 { x_max } else { 1.0 },
            y_max: if y_max > 0.0 { y_max * 1.05 } else { 1.0 },
        }
    }
    fn x(&self, x: f64) -> f64 {
        MARGIN_LEFT + x / self.x_max * (self.width - MARGIN_LEFT - MARGIN_RIGHT)
    }
    fn y(&self, y: f64) -> f64 {
        self.height - MARGIN_BOTTOM - y / self.y_max * (self.height - MARGIN_TOP - MARGIN_BOTTOM)
    }
    /// The step line of a series as pixel segments.
    fn steps(&self, points: &[(f64, f64)]) -> Vec<(f64, f64)> {
        let mut out = Vec::with_capacity(points.len() * 2);
        for (i, &(x, y)) in points.iter().enumerate() {
            if i > 0 {
                out.push((self.x(x), self.y(points[i - 1].1)));
            }
            out.push((self.x(x), self.y(y)));
        }
        if let Some(&(_, y)) = points.last() {
            out.push((self.x(self.x_max), self.y(y)));
        }
        out
    }
}

fn tick_label(value: f64) -> String {
    const UNITS: [(&str, f64); 4] = [
        ("TiB", 1099511627776.0),
        ("GiB", 1073741824.0),
        ("MiB", 1048576.0),
        ("KiB", 1024.0),
    ];
    for (unit, scale) in UNITS {
        if value >= scale {
            return format!("{:.1} {unit}", value / scale);
        }
    }
    format!("{value:.0}")
}

fn hex(color: [u8; 3]) -> String {
    format!("#{:02x}{:02x}{:02x}", color[0], color[1], color[2])
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

impl Chart {
    /// The chart as a standalone SVG document.
    pub fn to_svg(&self) -> String {
        let (w, h) = (1000.0, 500.0);
        let f = Frame::new(self, w, h);
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="24" font-size="15" text-anchor="middle">{}</text>"#,
            w / 2.0,
            escape(&self.title)
        );
        for i in 0..=TICKS {
            let yv = f.y_max * i as f64 / TICKS as f64;
            let xv = f.x_max * i as f64 / TICKS as f64;
            let _ = writeln!(
                s,
                r##"<line x1="{l}" x2="{r}" y1="{y:.1}" y2="{y:.1}" stroke="#e0e0e0"/><text x="{tx}" y="{ty:.1}" text-anchor="end">{label}</text>"##,
                l = MARGIN_LEFT,
                r = w - MARGIN_RIGHT,
                y = f.y(yv),
                tx = MARGIN_LEFT - 6.0,
                ty = f.y(yv) + 4.0,
                label = tick_label(yv)
            );
            let _ = writeln!(
                s,
                r#"<text x="{x:.1}" y="{y}" text-anchor="middle">{xv:.3}</text>"#,
                x = f.x(xv),
                y = h - MARGIN_BOTTOM + 16.0
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text><text x="16" y="{}" transform="rotate(-90 16 {})" text-anchor="middle">{}</text>"#,
            w / 2.0,
            h - 10.0,
            escape(&self.x_label),
            h / 2.0,
            h / 2.0,
            escape(&self.y_label)
        );
        for series in &self.series {
            let path: Vec<String> = f
                .steps(&series.points)
                .iter()
                .map(|(x, y)| format!("{x:.1},{y:.1}"))
                .collect();
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>"#,
                hex(series.color),
                path.join(" ")
            );
        }
        if let Some((label, y, color)) = &self.hline {
            let _ = writeln!(
                s,
                r#"<line x1="{}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="{c}" stroke-dasharray="6 4"/><text x="{}" y="{:.1}" fill="{c}" text-anchor="end">{}</text>"#,
                MARGIN_LEFT,
                w - MARGIN_RIGHT,
                w - MARGIN_RIGHT - 4.0,
                f.y(*y) - 4.0,
                escape(label),
                y = f.y(*y),
                c = hex(*color)
            );
        }
        for (i, series) in self.series.iter().enumerate() {
            let y = MARGIN_TOP + 14.0 + 16.0 * i as f64;
            let _ = writeln!(
                s,
                r#"<rect x="{}" y="{:.1}" width="12" height="3" fill="{c}"/><text x="{}" y="{:.1}">{}</text>"#,
                MARGIN_LEFT + 10.0,
                y - 4.0,
                MARGIN_LEFT + 28.0,
                y,
                escape(&series.label),
                c = hex(series.color)
            );
        }
        s.push_str("</svg>\n");
        s
    }

    /// The chart as PNG bytes.
    pub fn to_png(&self, width: u32, height: u32) -> Result<Vec<u8>, PlotError> {
        let mut canvas = Canvas::new(width, height);
        let f = Frame::new(self, f64::from(width), f64::from(height));
        let grid = [225, 225, 225];
        let ink = [40, 40, 40];
        for i in 0..=TICKS {
            let yv = f.y_max * i as f64 / TICKS as f64;
            let xv = f.x_max * i as f64 / TICKS as f64;
            let y = f.y(yv);
            canvas.line((MARGIN_LEFT, y), (f.x(f.x_max), y), grid, 1);
            canvas.text(&tick_label(yv), 8.0, y - 5.0, ink);
            canvas.text(&format!("{xv:.3}"), f.x(xv) - 12.0, f.y(0.0) + 8.0, ink);
        }
        canvas.text(&self.title, MARGIN_LEFT, 12.0, ink);
        canvas.text(
            &self.x_label,
            f.x(f.x_max / 2.0),
            f64::from(height) - 20.0,
            ink,
        );
        for series in &self.series {
            let pts = f.steps(&series.points);
            for pair in pts.windows(2) {
                canvas.line(pair[0], pair[1], series.color, 2);
            }
        }
        if let Some((label, y, color)) = &self.hline {
            let py = f.y(*y);
            let mut x = MARGIN_LEFT;
            while x < f.x(f.x_max) {
                canvas.line((x, py), ((x + 8.0).min(f.x(f.x_max)), py), *color, 2);
                x += 14.0;
            }
            canvas.text(label, f.x(f.x_max) - 60.0, py - 14.0, *color);
        }
        for (i, series) in self.series.iter().enumerate() {
            let y = MARGIN_TOP + 10.0 + 16.0 * i as f64;
            canvas.line(
                (MARGIN_LEFT + 10.0, y),
                (MARGIN_LEFT + 24.0, y),
                series.color,
                3,
            );
            canvas.text(&series.label, MARGIN_LEFT + 30.0, y - 5.0, ink);
        }
        canvas.line((MARGIN_LEFT, f.y(0.0)), (f.x(f.x_max), f.y(0.0)), ink, 1);
        canvas.line((MARGIN_LEFT, f.y(0.0)), (MARGIN_LEFT, f.y(f.y_max)), ink, 1);
        canvas.encode()
    }
}

/// An RGB pixel buffer.
struct Canvas {
    width: u32,
    height: u32,
    rgb: Vec<u8>,
}

impl Canvas {
    fn new(width: u32, height: u32) -> Canvas {
        Canvas {
            width,
            height,
            rgb: vec![255; width as usize * height as usize * 3],
        }
    }

    fn put(&mut self, x: i64, y: i64, color: [u8; 3]) {
        if x < 0 || y < 0 || x >= i64::from(self.width) || y >= i64::from(self.height) {
            return;
        }
        let i = (y as usize * self.width as usize + x as usize) * 3;
        self.rgb[i..i + 3].copy_from_slice(&color);
    }

    /// A line `thickness` pixels wide, by stepping along its longer axis.
    fn line(&mut self, a: (f64, f64), b: (f64, f64), color: [u8; 3], thickness: i64) {
        let steps = (b.0 - a.0).abs().max((b.1 - a.1).abs()).ceil().max(1.0) as i64;
        for s in 0..=steps {
            let t = s as f64 / steps as f64;
            let x = (a.0 + (b.0 - a.0) * t).round() as i64;
            let y = (a.1 + (b.1 - a.1) * t).round() as i64;
            for dx in 0..thickness {
                for dy in 0..thickness {
                    self.put(x + dx - thickness / 2, y + dy - thickness / 2, color);
                }
            }
        }
    }

    /// Upper-case text in a 3x5 pixel font scaled by 2; unknown characters are skipped.
    fn text(&mut self, text: &str, x: f64, y: f64, color: [u8; 3]) {
        const SCALE: i64 = 2;
        let (mut cx, cy) = (x.round() as i64, y.round() as i64);
        for ch in text.chars() {
            if let Some(bits) = glyph(ch.to_ascii_uppercase()) {
                for (i, bit) in bits.bytes().enumerate() {
                    if bit == b'1' {
                        let (gx, gy) = ((i % 3) as i64, (i / 3) as i64);
                        for d in 0..SCALE * SCALE {
                            self.put(
                                cx + gx * SCALE + d % SCALE,
                                cy + gy * SCALE + d / SCALE,
                                color,
                            );
                        }
                    }
                }
            }
            cx += 4 * SCALE;
        }
    }

    fn encode(&self) -> Result<Vec<u8>, PlotError> {
        let mut out = Vec::new();
        let mut encoder = png::Encoder::new(&mut out, self.width, self.height);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder
            .write_header()
            .map_err(|e| PlotError(e.to_string()))?;
        writer
            .write_image_data(&self.rgb)
            .map_err(|e| PlotError(e.to_string()))?;
        writer.finish().map_err(|e| PlotError(e.to_string()))?;
        Ok(out)
    }
}

/// 3x5 glyphs, rows top to bottom, `1` = ink.
fn glyph(c: char) -> Option<&'static str> {
    Some(match c {
        '0' => "111101101101111",
        '1' => "010110010010111",
        '2' => "111001111100111",
        '3' => "111001111001111",
        '4' => "101101111001001",
        '5' => "111100111001111",
        '6' => "111100111101111",
        '7' => "111001001001001",
        '8' => "111101111101111",
        '9' => "111101111001111",
        'A' => "010101111101101",
        'B' => "110101110101110",
        'C' => "011100100100011",
        'D' => "110101101101110",
        'E' => "111100110100111",
        'F' => "111100110100100",
        'G' => "011100101101011",
        'H' => "101101111101101",
        'I' => "111010010010111",
        'J' => "001001001101010",
        'K' => "101101110101101",
        'L' => "100100100100111",
        'M' => "101111111101101",
        'N' => "110101101101101",
        'O' => "010101101101010",
        'P' => "110101110100100",
        'Q' => "010101101110011",
        'R' => "110101110101101",
        'S' => "011100010001110",
        'T' => "111010010010010",
        'U' => "101101101101111",
        'V' => "101101101101010",
        'W' => "101101111111101",
        'X' => "101101010101101",
        'Y' => "101101010010010",
        'Z' => "111001010100111",
        '.' => "000000000000010",
        ',' => "000000000010100",
        '-' => "000000111000000",
        '+' => "000010111010000",
        ':' => "000010000010000",
        '%' => "101001010100101",
        '(' => "001010010010001",
        ')' => "100010010010100",
        '/' => "001001010100100",
        '_' => "000000000000111",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart() -> Chart {
        Chart {
            title: "t <1>".into(),
            x_label: "time".into(),
            y_label: "bytes".into(),
            series: vec![Series::new(
                "a",
                vec![(0.0, 1.0), (1.0, 3.0), (2.0, 2.0)],
                [0, 0, 255],
            )],
            hline: Some(("budget".into(), 2.5, [255, 0, 0])),
        }
    }

    #[test]
    fn svg_has_series_budget_and_escaped_title() {
        let svg = chart().to_svg();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("t &lt;1&gt;"));
        assert!(svg.contains("#0000ff") && svg.contains("#ff0000"));
    }

    #[test]
    fn png_decodes_with_the_series_color() {
        let bytes = chart().to_png(300, 200).unwrap();
        let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), (300, 200));
        assert!(buf.chunks(3).any(|p| p == [0, 0, 255]));
        assert!(buf.chunks(3).any(|p| p == [255, 0, 0]));
    }
}
