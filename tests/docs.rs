//! The docs book holds together: its generated pages are what the code
//! generates, every page is in its table of contents and compiled for its
//! snippets, every relative link and anchor resolves, and the README stays
//! a short front door.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every page of the book, relative to docs/src.
fn pages() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    let src = root().join("docs/src");
    let mut out = Vec::new();
    walk(&src, &mut out);
    out.sort();
    out.iter()
        .map(|p| p.strip_prefix(&src).unwrap().to_path_buf())
        .collect()
}

const GENERATED: [&str; 2] = ["reference/cli.md", "benchmarks/results.md"];

#[test]
fn generated_pages_are_what_the_code_generates() {
    let out = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(["docs", "--check", "--book"])
        .arg(root().join("docs"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn every_page_is_in_the_summary_and_compiled_for_its_snippets() {
    let summary = std::fs::read_to_string(root().join("docs/src/SUMMARY.md")).unwrap();
    let lib = std::fs::read_to_string(root().join("src/lib.rs")).unwrap();
    let listed: BTreeSet<String> = links(&summary).into_iter().collect();
    for page in pages() {
        let name = page.to_string_lossy().into_owned();
        if name == "SUMMARY.md" {
            continue;
        }
        assert!(listed.contains(&name), "{name} is not in SUMMARY.md");
        if !GENERATED.contains(&name.as_str()) {
            let include = format!("include_str!(\"../docs/src/{name}\")");
            assert!(
                lib.contains(&include),
                "src/lib.rs's `book` does not {include}"
            );
        }
    }
    for name in listed {
        assert!(
            root().join("docs/src").join(&name).is_file(),
            "SUMMARY.md lists {name}, which does not exist"
        );
    }
}

#[test]
fn relative_links_and_anchors_resolve() {
    let mut files: Vec<PathBuf> = pages()
        .into_iter()
        .map(|p| root().join("docs/src").join(p))
        .collect();
    files.extend(["README.md", "CHANGELOG.md", "ARCHITECTURE.md"].map(|f| root().join(f)));
    let mut broken = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = link.split_once('#').unwrap_or((&link, ""));
            let target = match path {
                "" => file.clone(),
                p => file.parent().unwrap().join(p),
            };
            let inside = target
                .canonicalize()
                .is_ok_and(|t| t.starts_with(root().canonicalize().unwrap()));
            if !inside {
                broken.push(format!(
                    "{}: {link} (no such file in the repository)",
                    file.display()
                ));
                continue;
            }
            if !anchor.is_empty() && target.extension().is_some_and(|e| e == "md") {
                let headings = std::fs::read_to_string(&target).unwrap();
                if !anchors(&headings).contains(anchor) {
                    broken.push(format!("{}: {link} (no such heading)", file.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_readme_is_a_front_door() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= 150,
        "README.md has {lines} lines: the rest belongs in the book"
    );
    assert!(
        !readme.contains("../"),
        "README.md points outside the repository"
    );
    // The two quick-start commands, exactly.
    assert!(readme.contains("cargo run --release -- bench dlrm --preset kaggle"));
    assert!(readme.contains("\nscripts/test "));
}

/// The targets of a Markdown text's inline links `[text](target)`, outside
/// code blocks and spans.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_code = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        // Code spans hold no links.
        let plain: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = plain.as_str();
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            let target = after[..end].split_whitespace().next().unwrap_or("");
            if !target.is_empty() {
                out.push(target.to_string());
            }
            rest = &after[end..];
        }
    }
    out
}

/// The anchors of a Markdown text's headings, as mdBook and GitHub make
/// them: lower case, spaces as dashes, other punctuation dropped.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut in_code = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
        }
        if in_code || !line.starts_with('#') {
            continue;
        }
        let title = line.trim_start_matches('#').trim();
        let slug: String = title
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        out.insert(slug);
    }
    out
}
