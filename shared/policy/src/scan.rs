//! The dry-run scan: what a plan would execute beyond the providers themselves.
//!
//! A plan changes no infrastructure, but it reads every data source with the run's
//! credentials: an `external` data source runs the program it names, an
//! `aws_lambda_invocation` invokes its function, and an `http` data source sends its request.
//! Before a rule exempts a plan with `exclude_dry_run`, the gate reads the configuration and
//! every module it calls (`.tf` and `.tofu` files with hcl-rs, `.tf.json`/`.tofu.json` with
//! serde_json) and reports each of those data sources by address, plus everything it could
//! not read. A report that is not [`ScanReport::is_clean`] means the plan is held as the real
//! run it may be.
//!
//! What the scan never does: read a `.terraform` it was not handed (a committed or left-over
//! one could hold anything, and no setting makes it trusted), follow a local module path or a
//! symlink out of the tree it belongs to, guess the value of a module source built from an
//! expression, or put file contents into its report (a parse error names the file and the
//! line and column, never the text, since a configuration may hold a literal secret). It does
//! no network I/O: registry and remote modules are read where the gate's own `get` installed
//! them, as listed in that directory's `modules.json`.
//!
//! The scan targets those three data sources and unreadable configuration only; it does not
//! prove a plan harmless.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;
use std::fs;
use std::path::{Component, Path, PathBuf};

/// Largest configuration file the scan reads; a larger one is unreadable rather than a
/// reason to hold the gate's memory.
const MAX_FILE_BYTES: u64 = 16 * 1024 * 1024;
/// Deepest module nesting followed; deeper calls are unreadable (tofu itself would refuse
/// long before, and a bound keeps a hostile configuration from stalling the gate).
const MAX_DEPTH: usize = 32;
/// Most module instances read in one scan (a call graph with fan-out at every level would
/// otherwise be read exponentially many times).
const MAX_MODULES: usize = 1000;

/// What the scan found: every flagged data source, everything it could not read, and the
/// modules it read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ScanReport {
    /// Data sources that execute something or write somewhere when the plan reads them.
    pub findings: Vec<Finding>,
    /// Files and modules the scan could not read in full; each one makes the plan unproven.
    pub unreadable: Vec<Unreadable>,
    /// Addresses of the called modules whose files were read (`module.network`,
    /// `module.network.module.inner`), in the order they were read; the root module is
    /// not listed. The same module called twice is listed at both addresses.
    pub modules_read: Vec<String>,
    /// The digest of the installed module tree the scan read (set by the pipeline, which
    /// computed it): a hold binds it, so a released plan runs exactly these modules.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modules_digest: Option<String>,
}

/// A data source the plan would read that runs code or sends a write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Finding {
    /// The data source's address, module path included
    /// (`module.network.data.external.lookup`), so the approver can find it. Addresses are
    /// static: a module or data source with `count`/`for_each` is named without instance keys.
    pub address: String,
    /// Why it is flagged.
    #[serde(flatten)]
    pub kind: FindingKind,
    /// The file that declares it, relative to the configuration directory.
    pub file: String,
}

/// Why a data source is flagged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FindingKind {
    /// `data "external"`: runs the program it names.
    External,
    /// `data "aws_lambda_invocation"`: invokes a Lambda function.
    LambdaInvocation,
    /// `data "http"` whose method is neither GET nor HEAD.
    HttpWrite {
        /// The method as written; `None` when it is not a plain string (a variable or an
        /// expression), which counts as a write because its value is only known at plan time.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        method: Option<String>,
    },
    /// `data "http"` that carries a `request_body`.
    HttpBody,
}

/// A file or module the scan could not read in full.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Unreadable {
    /// The file (relative to the configuration directory) or the module address
    /// (`module.network`); `.` is the configuration directory itself.
    pub what: String,
    /// Why, in words an approver can act on. Never holds file contents.
    pub reason: String,
}

impl ScanReport {
    /// Nothing flagged and everything read: the only state in which a rule may exempt the plan.
    pub fn is_clean(&self) -> bool {
        self.findings.is_empty() && self.unreadable.is_empty()
    }

    /// The report as audit evidence:
    /// `{"clean", "findings": [{"address","kind","method"?,"file"}], "unreadable": [{"what","reason"}], "modulesRead"}`.
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).unwrap_or_default();
        if let serde_json::Value::Object(m) = &mut v {
            m.insert("clean".into(), serde_json::Value::Bool(self.is_clean()));
        }
        v
    }
}

impl FindingKind {
    /// What the plan would do when it reads the data source, for the approver.
    pub fn describe(&self) -> String {
        match self {
            FindingKind::External => "runs a program (external data source)".to_owned(),
            FindingKind::LambdaInvocation => {
                "invokes a Lambda function (aws_lambda_invocation data source)".to_owned()
            }
            FindingKind::HttpWrite { method: Some(m) } => {
                format!("sends an HTTP {m} request (http data source)")
            }
            FindingKind::HttpWrite { method: None } => {
                "sends an HTTP request whose method is only known at plan time (http data source)"
                    .to_owned()
            }
            FindingKind::HttpBody => {
                "sends an HTTP request with a body (http data source)".to_owned()
            }
        }
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} (in {})",
            self.address,
            self.kind.describe(),
            self.file
        )
    }
}

impl fmt::Display for Unreadable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.what, self.reason)
    }
}

/// Scans the configuration in `config_dir` and every module it calls. Local module paths
/// may not leave `config_dir`; see [`scan_in_checkout`] for configurations that call
/// sibling directories of the same checkout.
///
/// `modules_dir` is where the gate's own `get` installed registry and remote modules
/// (`<config_dir>/.terraform/modules`, holding `modules.json`); `None` when nothing was
/// downloaded, in which case every non-local module is unreadable.
pub fn scan(config_dir: &Path, modules_dir: Option<&Path>) -> ScanReport {
    scan_in_checkout(config_dir, config_dir, modules_dir)
}

/// [`scan`] for a configuration directory inside a checkout: local module paths may reach
/// anywhere inside `checkout` (`source = "../modules/vpc"`), never outside it. A
/// `config_dir` outside `checkout` is unreadable.
pub fn scan_in_checkout(
    checkout: &Path,
    config_dir: &Path,
    modules_dir: Option<&Path>,
) -> ScanReport {
    let mut report = ScanReport::default();
    let config = match absolute(config_dir) {
        Ok(p) => p,
        Err(reason) => {
            report.unreadable.push(Unreadable {
                what: ".".into(),
                reason,
            });
            return report;
        }
    };
    let checkout_bound = match Bound::new(checkout) {
        Ok(b) => b,
        Err(reason) => {
            report.unreadable.push(Unreadable {
                what: ".".into(),
                reason: format!("the checkout cannot be read: {reason}"),
            });
            return report;
        }
    };
    let modules = modules_dir.map(|dir| Manifest::load(dir, &config));
    let mut scanner = Scanner {
        config,
        modules,
        report,
        instances: 0,
    };
    let root = scanner.config.clone();
    scanner.read_module(&root, &checkout_bound, &[], &mut Vec::new());
    scanner.report
}

/// A tree the files of one module may not leave: the checkout for local modules, the
/// gate's modules directory for downloaded ones.
#[derive(Clone)]
struct Bound {
    /// The root, absolute and lexically normalized (for `..` in module sources).
    lexical: PathBuf,
    /// The root with symlinks resolved (for files and directories that are symlinks).
    canonical: PathBuf,
}

impl Bound {
    fn new(root: &Path) -> Result<Bound, String> {
        let lexical = absolute(root)?;
        let canonical = fs::canonicalize(&lexical).map_err(|e| e.to_string())?;
        Ok(Bound { lexical, canonical })
    }
}

/// Where the gate's download put the module with this key, and the tree it may not leave.
fn locate(manifest: &Manifest, key: &str, source: &str) -> Result<(PathBuf, Bound), String> {
    let entries = manifest
        .entries
        .as_ref()
        .map_err(|reason| format!("the module {source:?} was left unread: {reason}"))?;
    let bound = manifest.bound.as_ref().map_err(Clone::clone)?;
    let dir = entries
        .get(key)
        .ok_or_else(|| format!("the module {source:?} could not be downloaded (it is not in modules.json), so it was left unread"))?;
    if !dir.starts_with(&bound.lexical) {
        return Err(
            "modules.json places the module outside the downloaded modules directory".to_owned(),
        );
    }
    Ok((dir.clone(), bound.clone()))
}

/// The gate's `modules.json`: module key (`network.inner`) → installed directory.
struct Manifest {
    bound: Result<Bound, String>,
    entries: Result<HashMap<String, PathBuf>, String>,
}

#[derive(Deserialize)]
struct ManifestFile {
    #[serde(rename = "Modules", default)]
    modules: Vec<ManifestEntry>,
}

#[derive(Deserialize)]
struct ManifestEntry {
    #[serde(rename = "Key")]
    key: String,
    #[serde(rename = "Dir")]
    dir: String,
}

impl Manifest {
    fn load(modules_dir: &Path, config: &Path) -> Manifest {
        let bound = Bound::new(modules_dir)
            .map_err(|e| format!("the downloaded modules directory cannot be read: {e}"));
        let entries = (|| {
            let path = modules_dir.join("modules.json");
            let text = fs::read_to_string(&path)
                .map_err(|e| format!("modules.json cannot be read: {e}"))?;
            let file: ManifestFile = serde_json::from_str(&text)
                .map_err(|e| format!("modules.json is not valid: {e}"))?;
            // Terraform records each Dir relative to the working directory.
            Ok(file
                .modules
                .into_iter()
                .filter(|m| !m.key.is_empty())
                .map(|m| (m.key, normalize(&config.join(m.dir))))
                .collect())
        })();
        Manifest { bound, entries }
    }
}

struct Scanner {
    config: PathBuf,
    modules: Option<Manifest>,
    report: ScanReport,
    instances: usize,
}

/// An attribute as the scan can know it without evaluating anything.
#[derive(Debug, Clone, PartialEq)]
enum Attr {
    Absent,
    Null,
    Literal(String),
    /// A variable, an interpolation, a function call or any other expression.
    Expr,
}

impl Attr {
    fn is_unset(&self) -> bool {
        matches!(self, Attr::Absent | Attr::Null)
    }
}

struct DataDecl {
    ty: String,
    name: String,
    method: Attr,
    request_body: Attr,
}

struct ModuleCall {
    name: String,
    source: Attr,
}

#[derive(Default)]
struct Decls {
    data: Vec<DataDecl>,
    modules: Vec<ModuleCall>,
    /// Blocks the scan could not make sense of (the file stays unreadable).
    problems: Vec<String>,
}

fn address_of(path: &[String]) -> String {
    path.iter()
        .map(|m| format!("module.{m}"))
        .collect::<Vec<_>>()
        .join(".")
}

impl Scanner {
    fn unreadable(&mut self, what: impl Into<String>, reason: impl Into<String>) {
        self.report.unreadable.push(Unreadable {
            what: what.into(),
            reason: reason.into(),
        });
    }

    fn display(&self, path: &Path) -> String {
        relative(path, &self.config)
    }

    fn module_what(&self, path: &[String]) -> String {
        if path.is_empty() {
            ".".to_owned()
        } else {
            address_of(path)
        }
    }

    /// Reads one module instance: its own files (tofu reads no subdirectory), then every
    /// module it calls. `dir` is absolute and lexically normalized; `stack` holds the
    /// canonical directories of the calls above it, to stop a module that calls itself.
    fn read_module(
        &mut self,
        dir: &Path,
        bound: &Bound,
        path: &[String],
        stack: &mut Vec<PathBuf>,
    ) {
        let what = self.module_what(path);
        self.instances += 1;
        if self.instances > MAX_MODULES {
            self.unreadable(
                what,
                format!("more than {MAX_MODULES} module calls; the rest were not read"),
            );
            return;
        }
        if path.len() > MAX_DEPTH {
            self.unreadable(
                what,
                format!("modules nested more than {MAX_DEPTH} deep were not read"),
            );
            return;
        }
        let canonical = match fs::canonicalize(dir) {
            Ok(c) => c,
            Err(e) => {
                self.unreadable(
                    what,
                    format!(
                        "the module directory {} cannot be read: {e}",
                        self.display(dir)
                    ),
                );
                return;
            }
        };
        if !canonical.starts_with(&bound.canonical) {
            self.unreadable(
                what,
                format!(
                    "the module directory {} links outside the tree it belongs to",
                    self.display(dir)
                ),
            );
            return;
        }
        if stack.contains(&canonical) {
            self.unreadable(what, "the module calls itself");
            return;
        }
        let mut names = match fs::read_dir(dir) {
            Ok(entries) => match entries
                .map(|e| e.map(|e| e.file_name()))
                .collect::<Result<Vec<_>, _>>()
            {
                Ok(names) => names,
                Err(e) => {
                    self.unreadable(what, format!("the module directory cannot be listed: {e}"));
                    return;
                }
            },
            Err(e) => {
                self.unreadable(
                    what,
                    format!(
                        "the module directory {} cannot be listed: {e}",
                        self.display(dir)
                    ),
                );
                return;
            }
        };
        names.sort();
        if !path.is_empty() {
            self.report.modules_read.push(what.clone());
        }
        let prefix = if path.is_empty() {
            String::new()
        } else {
            format!("{what}.")
        };
        let mut calls = Vec::new();
        for name in names {
            let file = dir.join(&name);
            let Some(name) = name.to_str() else {
                if config_extension(&name.to_string_lossy()).is_some() {
                    self.unreadable(self.display(&file), "the file name is not UTF-8");
                }
                continue;
            };
            let Some(syntax) = config_extension(name) else {
                continue;
            };
            if ignored(name) {
                continue;
            }
            let shown = self.display(&file);
            let Some(decls) = self.read_file(&file, &shown, syntax, bound) else {
                continue;
            };
            for problem in decls.problems {
                self.unreadable(shown.clone(), problem);
            }
            for d in decls.data {
                let address = format!("{prefix}data.{}.{}", d.ty, d.name);
                for kind in judge(&d) {
                    self.report.findings.push(Finding {
                        address: address.clone(),
                        kind,
                        file: shown.clone(),
                    });
                }
            }
            calls.extend(decls.modules.into_iter().map(|m| (m, shown.clone())));
        }
        stack.push(canonical);
        for (call, file) in calls {
            let mut child = path.to_vec();
            child.push(call.name.clone());
            self.follow(dir, bound, &child, &call.source, &file, stack);
        }
        stack.pop();
    }

    /// Resolves one module call and reads it, or records why it was left unread.
    fn follow(
        &mut self,
        parent: &Path,
        bound: &Bound,
        path: &[String],
        source: &Attr,
        file: &str,
        stack: &mut Vec<PathBuf>,
    ) {
        let what = address_of(path);
        let source = match source {
            Attr::Literal(s) => s.clone(),
            Attr::Absent | Attr::Null => {
                self.unreadable(what, format!("the module call in {file} has no source"));
                return;
            }
            Attr::Expr => {
                self.unreadable(
                    what,
                    format!("the module source in {file} is built from an expression; its value is only known when the run plans, so it was left unread"),
                );
                return;
            }
        };
        if is_local(&source) {
            let target = normalize(&parent.join(&source));
            let Ok(rel) = target.strip_prefix(&bound.lexical) else {
                self.unreadable(
                    what,
                    format!("the local module path {source:?} leaves the tree it belongs to"),
                );
                return;
            };
            if rel.components().any(|c| c.as_os_str() == ".terraform") {
                self.unreadable(
                    what,
                    format!("the local module path {source:?} points into a .terraform directory the gate did not install; vendor the module instead"),
                );
                return;
            }
            self.read_module(&target, bound, path, stack);
            return;
        }
        let key = path.join(".");
        let located = match &self.modules {
            None => Err(format!(
                "the module {source:?} was not downloaded by the gate, so it was left unread"
            )),
            Some(manifest) => locate(manifest, &key, &source),
        };
        let (dir, modules_bound) = match located {
            Ok(found) => found,
            Err(reason) => {
                self.unreadable(what, reason);
                return;
            }
        };
        self.read_module(&dir, &modules_bound, path, stack);
    }

    /// Reads and parses one file, or records it as unreadable and returns `None`.
    fn read_file(
        &mut self,
        file: &Path,
        shown: &str,
        syntax: Syntax,
        bound: &Bound,
    ) -> Option<Decls> {
        let meta = match fs::symlink_metadata(file) {
            Ok(m) => m,
            Err(e) => {
                self.unreadable(shown, format!("cannot be read: {e}"));
                return None;
            }
        };
        if meta.file_type().is_symlink() {
            match fs::canonicalize(file) {
                Ok(target) if target.starts_with(&bound.canonical) => {}
                Ok(_) => {
                    self.unreadable(
                        shown,
                        "is a symlink that leads outside the tree it belongs to",
                    );
                    return None;
                }
                Err(e) => {
                    self.unreadable(shown, format!("is a symlink that cannot be followed: {e}"));
                    return None;
                }
            }
        }
        let meta = match fs::metadata(file) {
            Ok(m) => m,
            Err(e) => {
                self.unreadable(shown, format!("cannot be read: {e}"));
                return None;
            }
        };
        if meta.is_dir() {
            // tofu reads only files; a directory named like one is not configuration.
            return None;
        }
        if meta.len() > MAX_FILE_BYTES {
            self.unreadable(shown, format!("is larger than {MAX_FILE_BYTES} bytes"));
            return None;
        }
        let bytes = match fs::read(file) {
            Ok(b) => b,
            Err(e) => {
                self.unreadable(shown, format!("cannot be read: {e}"));
                return None;
            }
        };
        let Ok(text) = String::from_utf8(bytes) else {
            self.unreadable(shown, "is not UTF-8");
            return None;
        };
        let parsed = match syntax {
            Syntax::Hcl => parse_hcl(&text),
            Syntax::Json => parse_json(&text),
        };
        match parsed {
            Ok(d) => Some(d),
            Err(reason) => {
                self.unreadable(shown, reason);
                None
            }
        }
    }
}

/// The findings for one data source.
fn judge(d: &DataDecl) -> Vec<FindingKind> {
    match d.ty.as_str() {
        "external" => vec![FindingKind::External],
        "aws_lambda_invocation" => vec![FindingKind::LambdaInvocation],
        "http" => {
            let mut out = Vec::new();
            match &d.method {
                Attr::Absent | Attr::Null => {}
                Attr::Literal(m)
                    if m.eq_ignore_ascii_case("GET") || m.eq_ignore_ascii_case("HEAD") => {}
                Attr::Literal(m) => out.push(FindingKind::HttpWrite {
                    method: Some(m.clone()),
                }),
                Attr::Expr => out.push(FindingKind::HttpWrite { method: None }),
            }
            if !d.request_body.is_unset() {
                out.push(FindingKind::HttpBody);
            }
            out
        }
        _ => Vec::new(),
    }
}

#[derive(Clone, Copy)]
enum Syntax {
    Hcl,
    Json,
}

/// Which configuration files tofu and terraform load from a module directory.
fn config_extension(name: &str) -> Option<Syntax> {
    if name.ends_with(".tf.json") || name.ends_with(".tofu.json") {
        Some(Syntax::Json)
    } else if name.ends_with(".tf") || name.ends_with(".tofu") {
        Some(Syntax::Hcl)
    } else {
        None
    }
}

/// Files the tools skip (editor backups and hidden files), so they run nothing.
fn ignored(name: &str) -> bool {
    name.starts_with('.') || name.ends_with('~') || (name.starts_with('#') && name.ends_with('#'))
}

/// A module source tofu resolves as a path in the same tree rather than downloading.
fn is_local(source: &str) -> bool {
    ["./", "../", ".\\", "..\\"]
        .iter()
        .any(|p| source.starts_with(p))
}

fn parse_hcl(text: &str) -> Result<Decls, String> {
    let body = hcl::parse(text).map_err(|e| match e {
        // The message and position only: the offending line could hold a literal secret.
        hcl::Error::Parse(p) => {
            format!(
                "is not valid HCL (line {}, column {}): {}",
                p.location().line(),
                p.location().column(),
                p.message()
            )
        }
        other => format!("is not valid HCL: {other}"),
    })?;
    let mut decls = Decls::default();
    hcl_blocks(&body, &mut decls, true);
    Ok(decls)
}

fn hcl_blocks(body: &hcl::Body, decls: &mut Decls, top: bool) {
    for block in body.blocks() {
        let labels: Vec<&str> = block.labels.iter().map(|l| l.as_str()).collect();
        match (block.identifier.as_str(), labels.as_slice()) {
            ("data", [ty, name]) => decls.data.push(DataDecl {
                ty: (*ty).to_owned(),
                name: (*name).to_owned(),
                method: hcl_attr(&block.body, "method"),
                request_body: hcl_attr(&block.body, "request_body"),
            }),
            ("data", _) => decls
                .problems
                .push("has a data block without exactly a type and a name".to_owned()),
            ("module", [name]) if top => decls.modules.push(ModuleCall {
                name: (*name).to_owned(),
                source: hcl_attr(&block.body, "source"),
            }),
            ("module", _) if top => decls
                .problems
                .push("has a module block without exactly one name".to_owned()),
            // A check block's scoped data sources are read at plan time like any other.
            ("check", _) if top => hcl_blocks(&block.body, decls, false),
            _ => {}
        }
    }
}

fn hcl_attr(body: &hcl::Body, key: &str) -> Attr {
    let mut found = body.attributes().filter(|a| a.key.as_str() == key);
    match (found.next(), found.next()) {
        (None, _) => Attr::Absent,
        (Some(a), None) => hcl_value(&a.expr),
        // A duplicate is an error for tofu; the scan does not pick one.
        (Some(_), Some(_)) => Attr::Expr,
    }
}

fn hcl_value(expr: &hcl::Expression) -> Attr {
    match expr {
        hcl::Expression::String(s) => Attr::Literal(s.clone()),
        hcl::Expression::Null => Attr::Null,
        hcl::Expression::Parenthesis(inner) => hcl_value(inner),
        _ => Attr::Expr,
    }
}

/// The same reading for the JSON syntax, where every block level may be an object or an
/// array of objects and any string may be a template.
fn parse_json(text: &str) -> Result<Decls, String> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| {
        format!(
            "is not valid JSON (line {}, column {}): {:?}",
            e.line(),
            e.column(),
            e.classify()
        )
    })?;
    let top = value.as_object().ok_or("is not a JSON object")?;
    let mut decls = Decls::default();
    for (key, v) in top {
        match key.as_str() {
            "data" => json_data(v, &mut decls)?,
            "module" => {
                for (name, body) in json_labelled(v, "module")? {
                    decls.modules.push(ModuleCall {
                        name: name.clone(),
                        source: json_attr(body, "source"),
                    });
                }
            }
            "check" => {
                for (_, body) in json_labelled(v, "check")? {
                    if let Some(data) = body.get("data") {
                        json_data(data, &mut decls)?;
                    }
                }
            }
            _ => {}
        }
    }
    Ok(decls)
}

fn json_data(v: &serde_json::Value, decls: &mut Decls) -> Result<(), String> {
    for obj in json_objects(v, "data")? {
        for (ty, by_name) in obj.iter().filter(|(k, _)| k.as_str() != "//") {
            for (name, body) in json_labelled(by_name, "data")? {
                decls.data.push(DataDecl {
                    ty: ty.clone(),
                    name: name.clone(),
                    method: json_attr(body, "method"),
                    request_body: json_attr(body, "request_body"),
                });
            }
        }
    }
    Ok(())
}

type JsonMap = serde_json::Map<String, serde_json::Value>;

/// `{"name": body}` (each level an object or an array of objects) → (name, body) pairs.
fn json_labelled<'a>(
    v: &'a serde_json::Value,
    block: &str,
) -> Result<Vec<(&'a String, &'a JsonMap)>, String> {
    let mut out = Vec::new();
    for obj in json_objects(v, block)? {
        for (name, bodies) in obj.iter().filter(|(k, _)| k.as_str() != "//") {
            for body in json_objects(bodies, block)? {
                out.push((name, body));
            }
        }
    }
    Ok(out)
}

fn json_objects<'a>(v: &'a serde_json::Value, block: &str) -> Result<Vec<&'a JsonMap>, String> {
    let shape = || format!("has a {block} block whose JSON shape the scan does not understand");
    match v {
        serde_json::Value::Object(m) => Ok(vec![m]),
        serde_json::Value::Array(items) => items
            .iter()
            .map(|i| i.as_object().ok_or_else(shape))
            .collect(),
        _ => Err(shape()),
    }
}

fn json_attr(body: &JsonMap, key: &str) -> Attr {
    match body.get(key) {
        None => Attr::Absent,
        Some(serde_json::Value::Null) => Attr::Null,
        // In the JSON syntax every string is a template; one with a sequence is an expression.
        Some(serde_json::Value::String(s)) if !s.contains("${") && !s.contains("%{") => {
            Attr::Literal(s.clone())
        }
        Some(_) => Attr::Expr,
    }
}

/// An absolute, lexically normalized path (`.` dropped, `..` applied), without touching
/// symlinks: module sources are resolved the way tofu resolves them, as text.
fn absolute(p: &Path) -> Result<PathBuf, String> {
    std::path::absolute(p)
        .map(|a| normalize(&a))
        .map_err(|e| e.to_string())
}

fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other.as_os_str()),
        }
    }
    out
}

/// `path` relative to `base` (both absolute and normalized), with `..` where needed.
fn relative(path: &Path, base: &Path) -> String {
    let p: Vec<_> = path.components().collect();
    let b: Vec<_> = base.components().collect();
    let common = p.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let mut out = PathBuf::new();
    for _ in common..b.len() {
        out.push("..");
    }
    for c in &p[common..] {
        out.push(c.as_os_str());
    }
    if out.as_os_str().is_empty() {
        ".".to_owned()
    } else {
        out.to_string_lossy().into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tempfile::TempDir;

    fn write(dir: &Path, rel: &str, text: &str) {
        let path = dir.join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, text).unwrap();
    }

    fn config(files: &[(&str, &str)]) -> TempDir {
        let dir = TempDir::new().unwrap();
        for (rel, text) in files {
            write(dir.path(), rel, text);
        }
        dir
    }

    fn addresses(r: &ScanReport) -> Vec<(&str, &FindingKind)> {
        r.findings
            .iter()
            .map(|f| (f.address.as_str(), &f.kind))
            .collect()
    }

    /// Each data source that executes something at plan time is reported by address and
    /// file; ordinary data sources and resources of the same types are not.
    #[test]
    fn each_executing_data_source_is_found() {
        let dir = config(&[(
            "main.tf",
            r#"
data "external" "lookup" { program = ["sh", "-c", "echo {}"] }
data "aws_lambda_invocation" "fn" {
  function_name = "f"
  input         = "{}"
}
data "aws_caller_identity" "me" {}
resource "aws_lambda_invocation" "apply_time" {
  function_name = "f"
  input         = "{}"
}
"#,
        )]);
        let r = scan(dir.path(), None);
        assert_eq!(
            addresses(&r),
            vec![
                ("data.external.lookup", &FindingKind::External),
                (
                    "data.aws_lambda_invocation.fn",
                    &FindingKind::LambdaInvocation
                )
            ]
        );
        assert!(r.findings.iter().all(|f| f.file == "main.tf"));
        assert!(r.unreadable.is_empty());
        assert!(!r.is_clean());
    }

    /// An http data source is clean only with GET or HEAD (any case) and no body; any
    /// other method, a method the scan cannot read as a plain string, or a body is a write.
    #[test]
    fn http_reads_pass_and_writes_are_found() {
        let dir = config(&[(
            "http.tf",
            r#"
variable "m" { type = string }
data "http" "plain" { url = "https://example.com" }
data "http" "get" {
  url    = "https://example.com"
  method = "GET"
}
data "http" "head" {
  url    = "https://example.com"
  method = "head"
}
data "http" "post" {
  url    = "https://example.com"
  method = "POST"
}
data "http" "var" {
  url    = "https://example.com"
  method = var.m
}
data "http" "interp" {
  url    = "https://example.com"
  method = "${var.m}"
}
data "http" "body" {
  url          = "https://example.com"
  request_body = "x"
}
"#,
        )]);
        let r = scan(dir.path(), None);
        assert_eq!(
            addresses(&r),
            vec![
                (
                    "data.http.post",
                    &FindingKind::HttpWrite {
                        method: Some("POST".into())
                    }
                ),
                ("data.http.var", &FindingKind::HttpWrite { method: None }),
                ("data.http.interp", &FindingKind::HttpWrite { method: None }),
                ("data.http.body", &FindingKind::HttpBody),
            ]
        );
        assert!(r.unreadable.is_empty());

        let clean = config(&[(
            "http.tf",
            "data \"http\" \"ok\" {\n  url = \"https://example.com\"\n  method = \"GET\"\n}\n",
        )]);
        let r = scan(clean.path(), None);
        assert!(r.is_clean(), "{r:?}");
        assert_eq!(r.to_json()["clean"], true);
    }

    /// `.tofu` files are read as well as `.tf`; files the tools ignore and other
    /// extensions are not, and nor are subdirectories no module call names.
    #[test]
    fn tofu_files_are_read() {
        let dir = config(&[
            (
                "main.tofu",
                "data \"external\" \"t\" {\n  program = [\"true\"]\n}\n",
            ),
            ("notes.txt", "data \"external\" \"txt\" {}"),
            (".hidden.tf", "data \"external\" \"hidden\" {}"),
            ("stray/main.tf", "data \"external\" \"stray\" {}"),
        ]);
        let r = scan(dir.path(), None);
        assert_eq!(
            addresses(&r),
            vec![("data.external.t", &FindingKind::External)]
        );
        assert_eq!(r.findings[0].file, "main.tofu");
    }

    /// A local module is read, its findings carry the module path, nested calls recurse,
    /// and a path out of the configuration root is refused rather than followed.
    #[test]
    fn local_modules_are_read_with_prefixed_addresses() {
        let dir = config(&[
            (
                "main.tf",
                "module \"network\" {\n  source = \"./modules/network\"\n}\n",
            ),
            (
                "modules/network/main.tf",
                "module \"inner\" {\n  source = \"../inner\"\n}\ndata \"external\" \"lookup\" {\n  program = [\"x\"]\n}\n",
            ),
            (
                "modules/inner/main.tf",
                "data \"http\" \"w\" {\n  url = \"u\"\n  method = \"PUT\"\n}\n",
            ),
        ]);
        let r = scan(dir.path(), None);
        assert_eq!(
            addresses(&r),
            vec![
                (
                    "module.network.data.external.lookup",
                    &FindingKind::External
                ),
                (
                    "module.network.module.inner.data.http.w",
                    &FindingKind::HttpWrite {
                        method: Some("PUT".into())
                    }
                ),
            ]
        );
        assert_eq!(r.findings[0].file, "modules/network/main.tf");
        assert_eq!(
            r.modules_read,
            vec!["module.network", "module.network.module.inner"]
        );
        assert!(r.unreadable.is_empty(), "{:?}", r.unreadable);
        assert_eq!(
            r.to_json()["findings"][0]["address"],
            "module.network.data.external.lookup"
        );
        assert_eq!(r.to_json()["findings"][1]["kind"], "http_write");
        assert_eq!(r.to_json()["findings"][1]["method"], "PUT");
    }

    /// `..` past the configuration root is unreadable with `scan`, and allowed only as far
    /// as the checkout with `scan_in_checkout`.
    #[test]
    fn local_paths_stay_inside_the_root() {
        let checkout = config(&[
            (
                "infra/app/main.tf",
                "module \"shared\" {\n  source = \"../../modules/shared\"\n}\n",
            ),
            (
                "modules/shared/main.tf",
                "data \"external\" \"s\" {\n  program = [\"x\"]\n}\n",
            ),
        ]);
        let app = checkout.path().join("infra/app");
        let r = scan(&app, None);
        assert!(r.findings.is_empty());
        assert_eq!(r.unreadable.len(), 1);
        assert_eq!(r.unreadable[0].what, "module.shared");
        assert!(
            r.unreadable[0].reason.contains("leaves"),
            "{}",
            r.unreadable[0].reason
        );

        let r = scan_in_checkout(checkout.path(), &app, None);
        assert_eq!(
            addresses(&r),
            vec![("module.shared.data.external.s", &FindingKind::External)]
        );
        assert_eq!(r.findings[0].file, "../../modules/shared/main.tf");

        let escape = config(&[(
            "main.tf",
            "module \"up\" {\n  source = \"../../../../etc\"\n}\n",
        )]);
        let r = scan_in_checkout(escape.path(), escape.path(), None);
        assert_eq!(r.unreadable.len(), 1, "{r:?}");
    }

    /// A registry or remote module is read from where the gate's `get` installed it, by its
    /// key in modules.json, nested keys included; without the download it is unreadable.
    #[test]
    fn downloaded_modules_are_read_from_modules_json() {
        let dir = config(&[
            (
                "main.tf",
                "module \"network\" {\n  source = \"git::file:///srv/repos/network.git\"\n}\n",
            ),
            (
                ".terraform/modules/modules.json",
                r#"{"Modules":[{"Key":"","Source":"","Dir":"."},
                    {"Key":"network","Source":"git::file:///srv/repos/network.git","Dir":".terraform/modules/network"},
                    {"Key":"network.inner","Source":"app.terraform.io/x/inner/aws","Version":"1.0.0","Dir":".terraform/modules/network.inner"}]}"#,
            ),
            (
                ".terraform/modules/network/main.tf",
                "module \"inner\" {\n  source = \"app.terraform.io/x/inner/aws\"\n}\n",
            ),
            (
                ".terraform/modules/network.inner/main.tf",
                "data \"external\" \"lookup\" {\n  program = [\"x\"]\n}\n",
            ),
        ]);
        let modules = dir.path().join(".terraform/modules");
        let r = scan(dir.path(), Some(&modules));
        assert_eq!(
            addresses(&r),
            vec![(
                "module.network.module.inner.data.external.lookup",
                &FindingKind::External
            )]
        );
        assert_eq!(
            r.findings[0].file,
            ".terraform/modules/network.inner/main.tf"
        );
        assert_eq!(
            r.modules_read,
            vec!["module.network", "module.network.module.inner"]
        );
        assert!(r.unreadable.is_empty(), "{:?}", r.unreadable);

        // Not handed the download: the committed-looking .terraform is not read.
        let r = scan(dir.path(), None);
        assert!(r.findings.is_empty());
        assert_eq!(r.unreadable.len(), 1);
        assert_eq!(r.unreadable[0].what, "module.network");
    }

    /// A module the get did not install (missing from modules.json) is left unread.
    #[test]
    fn a_module_missing_from_the_download_is_unreadable() {
        let dir = config(&[
            (
                "main.tf",
                "module \"gone\" {\n  source = \"hashicorp/gone/aws\"\n}\n",
            ),
            (".terraform/modules/modules.json", r#"{"Modules":[]}"#),
        ]);
        let modules = dir.path().join(".terraform/modules");
        let r = scan(dir.path(), Some(&modules));
        assert_eq!(r.unreadable.len(), 1);
        assert_eq!(r.unreadable[0].what, "module.gone");
        assert!(!r.is_clean());
    }

    /// A module source built from a variable or an interpolation is never guessed at.
    #[test]
    fn a_variable_module_source_is_unreadable() {
        let dir = config(&[(
            "main.tf",
            "variable \"src\" { type = string }\nmodule \"v\" {\n  source = var.src\n}\nmodule \"t\" {\n  source = \"./${var.src}\"\n}\n",
        )]);
        let r = scan(dir.path(), None);
        let what: Vec<_> = r.unreadable.iter().map(|u| u.what.as_str()).collect();
        assert_eq!(what, vec!["module.v", "module.t"]);
        assert!(r.unreadable[0].reason.contains("expression"));
        assert!(r.modules_read.is_empty());
    }

    /// A file that does not parse is unreadable by name, without its contents in the report,
    /// and the rest of the configuration is still read.
    #[test]
    fn a_broken_file_is_unreadable() {
        let dir = config(&[
            (
                "broken.tf",
                "resource \"x\" \"y\" {\n  password = \"hunter2\" +\n}\n",
            ),
            (
                "ok.tf",
                "data \"external\" \"e\" {\n  program = [\"x\"]\n}\n",
            ),
        ]);
        let r = scan(dir.path(), None);
        assert_eq!(r.unreadable.len(), 1);
        assert_eq!(r.unreadable[0].what, "broken.tf");
        assert!(
            !r.unreadable[0].reason.contains("hunter2"),
            "{}",
            r.unreadable[0].reason
        );
        assert_eq!(
            addresses(&r),
            vec![("data.external.e", &FindingKind::External)]
        );
    }

    /// A `.terraform` left in the configuration is never read, even when the scan is handed
    /// a different download, and even when a local path points into it.
    #[test]
    fn a_committed_dot_terraform_is_ignored() {
        let dir = config(&[
            (
                "main.tf",
                "module \"m\" {\n  source = \"hashicorp/m/aws\"\n}\nmodule \"sneaky\" {\n  source = \"./.terraform/modules/m\"\n}\n",
            ),
            (
                ".terraform/modules/modules.json",
                r#"{"Modules":[{"Key":"m","Source":"hashicorp/m/aws","Dir":".terraform/modules/m"}]}"#,
            ),
            (
                ".terraform/modules/m/main.tf",
                "data \"external\" \"committed\" {\n  program = [\"x\"]\n}\n",
            ),
        ]);
        let gate = TempDir::new().unwrap();
        write(
            gate.path(),
            "modules.json",
            &format!(
                r#"{{"Modules":[{{"Key":"m","Source":"hashicorp/m/aws","Dir":"{}/m"}}]}}"#,
                gate.path().display()
            ),
        );
        write(gate.path(), "m/main.tf", "output \"x\" {\n  value = 1\n}\n");
        let r = scan(dir.path(), Some(gate.path()));
        assert!(r.findings.is_empty(), "{:?}", r.findings);
        assert_eq!(r.modules_read, vec!["module.m"]);
        assert_eq!(r.unreadable.len(), 1);
        assert_eq!(r.unreadable[0].what, "module.sneaky");
        assert!(r.unreadable[0].reason.contains(".terraform"));
    }

    /// The JSON syntax is read too, templates in it counting as expressions.
    #[test]
    fn json_files_are_read() {
        let dir = config(&[
            (
                "main.tf.json",
                r#"{"data": {"external": {"j": {"program": ["x"]}},
                         "http": {"get": {"url": "u"}, "w": [{"url": "u", "method": "${var.m}"}]}},
                "module": {"loc": {"source": "./m"}}}"#,
            ),
            (
                "m/main.tf",
                "data \"http\" \"b\" {\n  url = \"u\"\n  request_body = \"{}\"\n}\n",
            ),
        ]);
        let r = scan(dir.path(), None);
        assert_eq!(
            addresses(&r),
            vec![
                ("data.external.j", &FindingKind::External),
                ("data.http.w", &FindingKind::HttpWrite { method: None }),
                ("module.loc.data.http.b", &FindingKind::HttpBody),
            ]
        );
        assert!(r.unreadable.is_empty(), "{:?}", r.unreadable);
    }

    /// Data sources scoped to a check block are read at plan time and found too; a module
    /// calling itself stops with an unreadable entry instead of looping.
    #[test]
    fn check_blocks_and_self_calls() {
        let dir = config(&[(
            "main.tf",
            "check \"c\" {\n  data \"http\" \"p\" {\n    url = \"u\"\n    method = \"POST\"\n  }\n  assert {\n    condition = true\n    error_message = \"x\"\n  }\n}\nmodule \"me\" {\n  source = \"./\"\n}\n",
        )]);
        let r = scan(dir.path(), None);
        assert_eq!(
            addresses(&r),
            vec![(
                "data.http.p",
                &FindingKind::HttpWrite {
                    method: Some("POST".into())
                }
            )]
        );
        assert_eq!(r.unreadable.len(), 1);
        assert_eq!(r.unreadable[0].what, "module.me");
    }

    /// A symlinked file that leads out of the configuration is not read.
    #[cfg(unix)]
    #[test]
    fn symlinks_out_of_the_tree_are_unreadable() {
        let outside = config(&[(
            "evil.tf",
            "data \"external\" \"e\" {\n  program = [\"x\"]\n}\n",
        )]);
        let dir = config(&[]);
        std::os::unix::fs::symlink(outside.path().join("evil.tf"), dir.path().join("link.tf"))
            .unwrap();
        let r = scan(dir.path(), None);
        assert!(r.findings.is_empty());
        assert_eq!(r.unreadable.len(), 1);
        assert_eq!(r.unreadable[0].what, "link.tf");
    }

    /// The JSON evidence round-trips and says whether the scan was clean.
    #[test]
    fn report_json_round_trips() {
        let r = ScanReport {
            findings: vec![Finding {
                address: "data.http.x".into(),
                kind: FindingKind::HttpWrite { method: None },
                file: "a.tf".into(),
            }],
            unreadable: vec![Unreadable {
                what: "b.tf".into(),
                reason: "why".into(),
            }],
            modules_read: vec!["module.a".into()],
            modules_digest: Some("d".into()),
        };
        let v = r.to_json();
        assert_eq!(v["clean"], false);
        assert_eq!(v["modulesRead"][0], "module.a");
        let back: ScanReport = serde_json::from_value(v).unwrap();
        assert_eq!(back, r);
    }
}
