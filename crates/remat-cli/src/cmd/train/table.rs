//! Plain aligned text tables for comparisons.

/// Renders `rows` under `header`, columns padded to their widest cell; the first column is
/// left-aligned, the others right-aligned (they hold numbers).
pub fn render(header: &[&str], rows: &[Vec<String>]) -> String {
    let cols = header.len();
    let mut width: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in width.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut s = String::new();
        for (i, cell) in cells.enumerate().take(cols) {
            let pad = width[i] - cell.chars().count();
            if i > 0 {
                s.push_str("  ");
                s.push_str(&" ".repeat(pad));
                s.push_str(cell);
            } else {
                s.push_str(cell);
                s.push_str(&" ".repeat(pad));
            }
        }
        s.trim_end().to_string()
    };
    let mut out = line(&mut header.iter().copied());
    out.push('\n');
    out.push_str(
        &width
            .iter()
            .map(|&w| "-".repeat(w))
            .collect::<Vec<_>>()
            .join("  "),
    );
    out.push('\n');
    for row in rows {
        out.push_str(&line(&mut row.iter().map(String::as_str)));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn aligns_columns() {
        let t = super::render(
            &["policy", "ms"],
            &[
                vec!["store-all".into(), "12.5".into()],
                vec!["sqrt".into(), "7".into()],
            ],
        );
        assert_eq!(
            t,
            "policy       ms\n---------  ----\nstore-all  12.5\nsqrt          7\n"
        );
    }
}
