//! Plain aligned text tables. Every table remat prints goes through [`render`]; the
//! [`Layout`] is the only thing that differs between them.

/// How a table is laid out. Column widths are the widest cell of each column (header
/// included, counted in characters); cells beyond the header's columns are not printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Columns two spaces apart, the first left-aligned and the others right-aligned (they
    /// hold numbers), a rule of dashes under the header: `remat train --compare` and the
    /// benchmarks' comparisons.
    Aligned,
    /// Markdown rows `| a | b |`, every column left-aligned, a `|---|---|` rule: the
    /// planner's tables, which are pasted into documents.
    Markdown,
    /// Left-aligned columns two spaces apart, a rule of dashes under the header: `remat
    /// bench auto`.
    Plain,
    /// [`Layout::Plain`] indented by two spaces under a heading: `remat spec` and the spec
    /// benchmarks.
    Indented,
}

/// Renders `rows` under `header` in `layout`, one line per row, each ending in a newline.
pub fn render(layout: Layout, header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = line(layout, &widths, &mut header.iter().copied());
    out.push_str(&rule(layout, &widths));
    for row in rows {
        out.push_str(&line(layout, &widths, &mut row.iter().map(String::as_str)));
    }
    out
}

/// Prints [`render`]'s table on standard output.
pub fn print_table(layout: Layout, header: &[&str], rows: &[Vec<String>]) {
    print!("{}", render(layout, header, rows));
}

/// One row of cells, padded to `widths`.
fn line(layout: Layout, widths: &[usize], cells: &mut dyn Iterator<Item = &str>) -> String {
    let padded = cells.zip(widths).enumerate().map(|(i, (cell, &w))| {
        let pad = " ".repeat(w.saturating_sub(cell.chars().count()));
        match layout {
            Layout::Aligned if i > 0 => format!("{pad}{cell}"),
            _ => format!("{cell}{pad}"),
        }
    });
    let cells: Vec<String> = padded.collect();
    match layout {
        Layout::Aligned => format!("{}\n", cells.join("  ").trim_end()),
        Layout::Markdown => format!("| {} |\n", cells.join(" | ")),
        Layout::Plain => format!("{}\n", cells.join("  ").trim_end()),
        Layout::Indented => format!("  {}\n", cells.join("  ").trim_end()),
    }
}

/// The rule under the header.
fn rule(layout: Layout, widths: &[usize]) -> String {
    let dashes =
        |extra: usize| -> Vec<String> { widths.iter().map(|w| "-".repeat(w + extra)).collect() };
    match layout {
        Layout::Aligned => format!("{}\n", dashes(0).join("  ")),
        Layout::Plain => format!("{}\n", dashes(0).join("  ").trim_end()),
        Layout::Markdown => format!("|{}|\n", dashes(2).join("|")),
        Layout::Indented => format!("  {}\n", dashes(0).join("  ").trim_end()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows() -> Vec<Vec<String>> {
        vec![
            vec!["store-all".into(), "12.5".into()],
            vec!["sqrt".into(), "7".into()],
        ]
    }

    #[test]
    fn aligned_puts_numbers_right() {
        assert_eq!(
            render(Layout::Aligned, &["policy", "ms"], &rows()),
            "policy       ms\n---------  ----\nstore-all  12.5\nsqrt          7\n"
        );
    }

    #[test]
    fn markdown_pads_every_column_left() {
        assert_eq!(
            render(Layout::Markdown, &["policy", "ms"], &rows()),
            "| policy    | ms   |\n|-----------|------|\n| store-all | 12.5 |\n| sqrt      | 7    |\n"
        );
    }

    #[test]
    fn indented_trims_trailing_space() {
        assert_eq!(
            render(Layout::Indented, &["policy", "ms"], &rows()),
            "  policy     ms\n  ---------  ----\n  store-all  12.5\n  sqrt       7\n"
        );
    }

    #[test]
    fn plain_is_indented_without_the_indent() {
        assert_eq!(
            render(Layout::Plain, &["policy", "ms"], &rows()),
            "policy     ms\n---------  ----\nstore-all  12.5\nsqrt       7\n"
        );
    }

    #[test]
    fn cells_beyond_the_header_are_dropped_and_short_rows_kept_short() {
        let rows = vec![
            vec!["a".to_string(), "b".into(), "extra".into()],
            vec!["long cell".to_string()],
        ];
        assert_eq!(
            render(Layout::Aligned, &["x", "y"], &rows),
            "x          y\n---------  -\na          b\nlong cell\n"
        );
        assert_eq!(
            render(Layout::Markdown, &["x", "y"], &rows),
            "| x         | y |\n|-----------|---|\n| a         | b |\n| long cell |\n"
        );
    }

    #[test]
    fn widths_count_characters_not_bytes() {
        let rows = vec![vec!["µs".to_string(), "1".into()]];
        assert_eq!(
            render(Layout::Indented, &["unit", "n"], &rows),
            "  unit  n\n  ----  -\n  µs    1\n"
        );
    }
}
