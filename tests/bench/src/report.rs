//! The figures table: each figure beside its reference from the same run, the ratio, and
//! the goal it is held to. A figure that misses its goal is reported, never failed on.

/// One figure.
#[derive(Debug, Clone)]
pub struct Row {
    /// The figure's number and a short name.
    pub figure: String,
    /// What Takosumi measured.
    pub value: String,
    /// The reference measured in the same run (or `—`).
    pub reference: String,
    /// Value relative to the reference, as the goal states it.
    pub ratio: String,
    /// The goal the figure is held to.
    pub goal: String,
    /// Whether the goal was met (`None` where there is no goal or it cannot be judged).
    pub met: Option<bool>,
}

/// All figures of one run plus the details printed under the table.
#[derive(Debug, Default)]
pub struct Report {
    /// Table rows, in figure order.
    pub rows: Vec<Row>,
    /// Sections of details (breakdowns, raw numbers), each a title and markdown lines.
    pub details: Vec<(String, Vec<String>)>,
}

impl Report {
    /// Adds a row.
    pub fn row(
        &mut self,
        figure: impl Into<String>,
        value: impl Into<String>,
        reference: impl Into<String>,
        ratio: impl Into<String>,
        goal: impl Into<String>,
        met: Option<bool>,
    ) {
        self.rows.push(Row {
            figure: figure.into(),
            value: value.into(),
            reference: reference.into(),
            ratio: ratio.into(),
            goal: goal.into(),
            met,
        });
    }

    /// Adds a details section.
    pub fn detail(&mut self, title: impl Into<String>, lines: Vec<String>) {
        self.details.push((title.into(), lines));
    }

    /// The report as markdown.
    pub fn markdown(&self, machine: &[(String, String)]) -> String {
        let mut s = String::new();
        s.push_str("### Machine\n\n| | |\n|---|---|\n");
        for (k, v) in machine {
            s.push_str(&format!("| {k} | {} |\n", v.replace('|', "/")));
        }
        s.push_str("\n### Figures\n\n| figure | Takosumi | reference (same run) | ratio | goal | met |\n|---|---|---|---|---|---|\n");
        for r in &self.rows {
            let met = match r.met {
                Some(true) => "yes",
                Some(false) => "**no**",
                None => "—",
            };
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {met} |\n",
                r.figure, r.value, r.reference, r.ratio, r.goal
            ));
        }
        for (title, lines) in &self.details {
            s.push_str(&format!("\n#### {title}\n\n"));
            for l in lines {
                s.push_str(l);
                s.push('\n');
            }
        }
        s
    }
}
