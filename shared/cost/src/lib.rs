//! Cost estimates of a plan: the resource-change summary a plan step keeps from
//! `show -json`, the price catalogue kept in the repository (`infra/pricing/catalogue.json`,
//! embedded at build time), and the estimate computed from both.
//!
//! The summary exists so that nothing needs the sealed plan (a secret) to answer a cost
//! question: it holds each managed resource's address, type and actions and only the
//! attributes the catalogue prices by (`instance_type`, …); a value the plan marks sensitive
//! is never copied, only the attribute's name is noted. A resource type or size the
//! catalogue does not list is reported as unpriced, with the reason; a price is never
//! guessed. Pure computation: no I/O.
#![deny(missing_docs)]

use std::collections::BTreeMap;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The catalogue as kept in the repository.
pub const CATALOGUE_JSON: &str = include_str!("../../../infra/pricing/catalogue.json");

/// At most this many resources are kept in a plan's summary (the row stays bounded; a
/// bigger plan is estimated over the first ones and says it was truncated).
pub const MAX_SUMMARY_RESOURCES: usize = 10_000;

/// A price attribute value longer than this is not a size name: it is not kept.
const MAX_ATTRIBUTE_CHARS: usize = 200;

/// Amounts are summed in ten-thousandths of the currency unit, so totals do not drift.
const UNITS_PER_CURRENCY: f64 = 10_000.0;

/// Why the catalogue text cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CatalogueError {
    /// Not the catalogue's JSON shape.
    #[error("the price catalogue is not valid: {0}")]
    Json(#[from] serde_json::Error),
    /// A resource entry is inconsistent.
    #[error("the price catalogue entry for {resource_type} is not valid: {reason}")]
    Entry {
        /// The resource type.
        resource_type: String,
        /// What is wrong.
        reason: &'static str,
    },
}

/// How one resource type is priced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PriceEntry {
    /// A flat monthly price, whatever the attributes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub monthly: Option<f64>,
    /// The attribute whose value selects the price (`instance_type`, `machine_type`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price_by: Option<String>,
    /// Monthly price by attribute value.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub prices: BTreeMap<String, f64>,
}

/// The price catalogue: monthly prices of common resource types.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Catalogue {
    /// ISO currency code.
    pub currency: String,
    /// The period prices are for (`month`).
    pub period: String,
    /// Hours the hourly list prices were multiplied by.
    pub hours_per_month: u32,
    /// When the prices were taken.
    pub as_of: String,
    /// What the prices include and leave out.
    pub note: String,
    /// Resource type → how it is priced.
    pub resources: BTreeMap<String, PriceEntry>,
}

fn valid_amount(x: f64) -> bool {
    x.is_finite() && (0.0..1e9).contains(&x)
}

impl Catalogue {
    /// Parses and checks a catalogue: each entry has either a flat `monthly` price or a
    /// `priceBy` attribute with prices, and every price is a finite, non-negative amount.
    pub fn parse(text: &str) -> Result<Self, CatalogueError> {
        let catalogue: Catalogue = serde_json::from_str(text)?;
        for (ty, entry) in &catalogue.resources {
            let bad = |reason| CatalogueError::Entry {
                resource_type: ty.clone(),
                reason,
            };
            match (&entry.monthly, &entry.price_by) {
                (Some(m), None) if entry.prices.is_empty() => {
                    if !valid_amount(*m) {
                        return Err(bad("monthly must be a non-negative amount"));
                    }
                }
                (None, Some(attr)) if !attr.is_empty() && !entry.prices.is_empty() => {
                    if !entry.prices.values().all(|p| valid_amount(*p)) {
                        return Err(bad("every price must be a non-negative amount"));
                    }
                }
                _ => {
                    return Err(bad(
                        "give either `monthly`, or `priceBy` with a non-empty `prices`",
                    ));
                }
            }
        }
        Ok(catalogue)
    }

    /// The catalogue built into this binary from `infra/pricing/catalogue.json`.
    pub fn embedded() -> &'static Catalogue {
        static EMBEDDED: OnceLock<Catalogue> = OnceLock::new();
        EMBEDDED.get_or_init(|| {
            // Checked by this module's tests: a broken catalogue fails the build's tests.
            Catalogue::parse(CATALOGUE_JSON).expect("infra/pricing/catalogue.json is valid")
        })
    }

    /// The attribute a resource type is priced by, if it is priced by one.
    pub fn price_attribute(&self, resource_type: &str) -> Option<&str> {
        self.resources
            .get(resource_type)
            .and_then(|e| e.price_by.as_deref())
    }
}

/// One managed resource instance of a plan, as much as a cost estimate needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourceChange {
    /// `aws_instance.web[0]`.
    pub address: String,
    /// `aws_instance`.
    #[serde(rename = "type")]
    pub resource_type: String,
    /// The tool's actions: `["create"]`, `["delete","create"]`, `["no-op"]`, …
    pub actions: Vec<String>,
    /// The priced attribute's value before the change (when there is a before and the
    /// value is neither sensitive nor structured).
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub before: Map<String, Value>,
    /// The priced attribute's value after the change.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub after: Map<String, Value>,
    /// Priced attributes whose value is not known until apply.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unknown: Vec<String>,
    /// Priced attributes the plan marks sensitive: only their names are kept.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sensitive: Vec<String>,
}

impl ResourceChange {
    fn has_before(&self) -> bool {
        self.actions != ["create"]
    }

    fn has_after(&self) -> bool {
        self.actions != ["delete"]
    }
}

/// A plan's resource changes, kept on the Run for cost estimates.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PlanResources {
    /// Managed resources, in the order `show -json` lists them.
    pub resources: Vec<ResourceChange>,
    /// More than [`MAX_SUMMARY_RESOURCES`] resources: the rest were left out.
    #[serde(default)]
    pub truncated: bool,
}

/// Whether a `*_sensitive` marker covers `attr`: the whole object marked `true`, or the
/// attribute marked `true` or holding any nested sensitive marker.
pub fn marked_sensitive(marker: Option<&Value>, attr: &str) -> bool {
    match marker {
        Some(Value::Bool(b)) => *b,
        Some(Value::Object(m)) => match m.get(attr) {
            Some(Value::Bool(b)) => *b,
            Some(Value::Object(o)) => !o.is_empty(),
            Some(Value::Array(a)) => !a.is_empty(),
            _ => false,
        },
        _ => false,
    }
}

/// A scalar attribute value worth keeping (a size name), or `None`.
fn price_key_value(v: Option<&Value>) -> Option<Value> {
    match v? {
        Value::String(s) if s.chars().count() <= MAX_ATTRIBUTE_CHARS => {
            Some(Value::String(s.clone()))
        }
        v @ (Value::Number(_) | Value::Bool(_)) => Some(v.clone()),
        _ => None,
    }
}

/// Builds the summary from `show -json <plan>`: managed resources only (data sources
/// change nothing that is billed), their actions, and for a type the catalogue prices by
/// an attribute, that attribute's value before and after — unless the plan marks it
/// sensitive (`before_sensitive` / `after_sensitive`), in which case only its name is kept.
/// A missing `resource_changes` key (a provider-free configuration) is an empty summary.
pub fn summarize(show_json: &Value, catalogue: &Catalogue) -> PlanResources {
    let mut out = PlanResources::default();
    let Some(changes) = show_json.get("resource_changes").and_then(Value::as_array) else {
        return out;
    };
    for rc in changes {
        if rc.get("mode").and_then(Value::as_str) == Some("data") {
            continue;
        }
        if out.resources.len() >= MAX_SUMMARY_RESOURCES {
            out.truncated = true;
            break;
        }
        let text = |key: &str| {
            rc.get(key)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        let change = rc.get("change");
        let actions: Vec<String> = change
            .and_then(|c| c.get("actions"))
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        let mut summary = ResourceChange {
            address: text("address"),
            resource_type: text("type"),
            actions,
            before: Map::new(),
            after: Map::new(),
            unknown: Vec::new(),
            sensitive: Vec::new(),
        };
        if let (Some(attr), Some(change)) =
            (catalogue.price_attribute(&summary.resource_type), change)
        {
            for (side, marker) in [("before", "before_sensitive"), ("after", "after_sensitive")] {
                let Some(values) = change.get(side).and_then(Value::as_object) else {
                    continue;
                };
                if marked_sensitive(change.get(marker), attr) {
                    if !summary.sensitive.iter().any(|s| s == attr) {
                        summary.sensitive.push(attr.to_owned());
                    }
                    continue;
                }
                if let Some(v) = price_key_value(values.get(attr)) {
                    let target = if side == "before" {
                        &mut summary.before
                    } else {
                        &mut summary.after
                    };
                    target.insert(attr.to_owned(), v);
                }
            }
            if summary.after.get(attr).is_none()
                && change
                    .get("after_unknown")
                    .and_then(|u| u.get(attr))
                    .and_then(Value::as_bool)
                    == Some(true)
            {
                summary.unknown.push(attr.to_owned());
            }
        }
        out.resources.push(summary);
    }
    out
}

/// Monthly amounts, in the catalogue's currency.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Amounts {
    /// What the resources cost as they are now.
    pub current: f64,
    /// What they cost once the plan is applied.
    pub proposed: f64,
    /// `proposed - current`.
    pub delta: f64,
}

/// One priced resource.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourceCost {
    /// Its address.
    pub address: String,
    /// Its type.
    #[serde(rename = "type")]
    pub resource_type: String,
    /// The plan's actions on it.
    pub actions: Vec<String>,
    /// Its monthly amounts.
    #[serde(flatten)]
    pub amounts: Amounts,
}

/// A resource the catalogue cannot price, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct UnpricedResource {
    /// Its address.
    pub address: String,
    /// Its type.
    #[serde(rename = "type")]
    pub resource_type: String,
    /// The plan's actions on it.
    pub actions: Vec<String>,
    /// Why it has no price.
    pub reason: String,
}

/// The cost estimate of a plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct CostEstimate {
    /// ISO currency code.
    pub currency: String,
    /// The period amounts are for (`month`).
    pub period: String,
    /// When the catalogue's prices were taken.
    pub catalogue_as_of: String,
    /// What the catalogue's prices include.
    pub catalogue_note: String,
    /// Priced resources.
    pub resources: Vec<ResourceCost>,
    /// Resources without a price: the totals leave them out.
    pub unpriced: Vec<UnpricedResource>,
    /// Sums over the priced resources.
    pub total: Amounts,
    /// Every resource was priced (and the summary was not truncated).
    pub complete: bool,
    /// The plan had more resources than the summary keeps.
    pub truncated: bool,
}

fn to_units(amount: f64) -> i64 {
    // Catalogue amounts are checked to be finite and below 1e9: this cannot overflow.
    (amount * UNITS_PER_CURRENCY).round() as i64
}

fn from_units(units: i64) -> f64 {
    (units as f64 / UNITS_PER_CURRENCY * 100.0).round() / 100.0
}

fn describe(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
}

/// The monthly price of one side (before or after) of a resource, or why there is none.
fn price_side(
    catalogue: &Catalogue,
    rc: &ResourceChange,
    values: &Map<String, Value>,
    after: bool,
) -> Result<i64, String> {
    let ty = &rc.resource_type;
    let Some(entry) = catalogue.resources.get(ty) else {
        return Err(format!("the price catalogue has no price for {ty}"));
    };
    if let Some(monthly) = entry.monthly {
        return Ok(to_units(monthly));
    }
    let attr = entry.price_by.as_deref().unwrap_or_default();
    let Some(value) = values.get(attr) else {
        return Err(if rc.sensitive.iter().any(|s| s == attr) {
            format!("{attr} is marked sensitive in the plan, so it is not read")
        } else if after && rc.unknown.iter().any(|s| s == attr) {
            format!("{attr} is not known until apply")
        } else {
            format!("{attr} is not set in the plan")
        });
    };
    let key = match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    entry.prices.get(&key).map(|p| to_units(*p)).ok_or_else(|| {
        format!(
            "the price catalogue has no price for {ty} with {attr} = {}",
            describe(value)
        )
    })
}

/// Prices every resource of `plan`: `current` from the state before the change (zero for
/// a create), `proposed` from the state after it (zero for a delete), `delta` the
/// difference; totals sum the priced resources only, and `complete` says whether any was
/// left unpriced.
pub fn estimate(catalogue: &Catalogue, plan: &PlanResources) -> CostEstimate {
    let mut resources = Vec::new();
    let mut unpriced = Vec::new();
    let (mut current_total, mut proposed_total) = (0i64, 0i64);
    for rc in &plan.resources {
        let current = if rc.has_before() {
            price_side(catalogue, rc, &rc.before, false)
        } else {
            Ok(0)
        };
        let proposed = if rc.has_after() {
            price_side(catalogue, rc, &rc.after, true)
        } else {
            Ok(0)
        };
        match (current, proposed) {
            (Ok(current), Ok(proposed)) => {
                current_total += current;
                proposed_total += proposed;
                resources.push(ResourceCost {
                    address: rc.address.clone(),
                    resource_type: rc.resource_type.clone(),
                    actions: rc.actions.clone(),
                    amounts: Amounts {
                        current: from_units(current),
                        proposed: from_units(proposed),
                        delta: from_units(proposed - current),
                    },
                });
            }
            (Err(reason), _) | (_, Err(reason)) => unpriced.push(UnpricedResource {
                address: rc.address.clone(),
                resource_type: rc.resource_type.clone(),
                actions: rc.actions.clone(),
                reason,
            }),
        }
    }
    CostEstimate {
        currency: catalogue.currency.clone(),
        period: catalogue.period.clone(),
        catalogue_as_of: catalogue.as_of.clone(),
        catalogue_note: catalogue.note.clone(),
        complete: unpriced.is_empty() && !plan.truncated,
        truncated: plan.truncated,
        resources,
        unpriced,
        total: Amounts {
            current: from_units(current_total),
            proposed: from_units(proposed_total),
            delta: from_units(proposed_total - current_total),
        },
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_repository_catalogue_is_valid_and_prices_null_resource_at_zero() {
        let c = Catalogue::embedded();
        assert_eq!(c.currency, "USD");
        assert_eq!(c.resources["null_resource"].monthly, Some(0.0));
        for ty in [
            "aws_instance",
            "aws_db_instance",
            "google_compute_instance",
            "azurerm_linux_virtual_machine",
        ] {
            assert!(c.price_attribute(ty).is_some(), "{ty}");
        }
        assert!(c.resources["aws_nat_gateway"].monthly.is_some());
        assert!(c.resources["aws_lb"].monthly.is_some());
    }

    #[test]
    fn inconsistent_catalogues_are_refused() {
        let bad = |resources: Value| {
            let text = json!({"currency": "USD", "period": "month", "hoursPerMonth": 730,
                "asOf": "x", "note": "n", "resources": resources})
            .to_string();
            Catalogue::parse(&text)
        };
        assert!(bad(json!({"a": {"monthly": -1.0}})).is_err());
        assert!(bad(json!({"a": {"priceBy": "size", "prices": {}}})).is_err());
        assert!(
            bad(json!({"a": {"monthly": 1.0, "priceBy": "size", "prices": {"s": 1.0}}})).is_err()
        );
        assert!(bad(json!({"a": {"price": 1.0}})).is_err());
        assert!(bad(json!({"a": {"priceBy": "size", "prices": {"s": 2.5}}})).is_ok());
    }

    /// A hand-written `show -json` with a resized instance, a new and a deleted one, a
    /// replaced database, a NAT gateway, a null_resource, an unknown type, an unknown
    /// size, a sensitive size and a data source.
    fn show() -> Value {
        json!({
            "format_version": "0.2",
            "resource_changes": [
                {"address": "aws_instance.web", "mode": "managed", "type": "aws_instance",
                 "change": {"actions": ["update"],
                    "before": {"instance_type": "t3.micro", "ami": "ami-1", "user_data": "secret-ish"},
                    "after": {"instance_type": "t3.large", "ami": "ami-1", "user_data": "secret-ish"},
                    "after_unknown": {}, "before_sensitive": {}, "after_sensitive": {}}},
                {"address": "aws_instance.new[0]", "mode": "managed", "type": "aws_instance",
                 "change": {"actions": ["create"], "before": null,
                    "after": {"instance_type": "m5.large"}, "after_unknown": {"id": true}}},
                {"address": "aws_instance.old", "mode": "managed", "type": "aws_instance",
                 "change": {"actions": ["delete"], "before": {"instance_type": "t3.small"}, "after": null}},
                {"address": "aws_db_instance.db", "mode": "managed", "type": "aws_db_instance",
                 "change": {"actions": ["delete", "create"],
                    "before": {"instance_class": "db.t3.micro", "password": "hunter2"},
                    "after": {"instance_class": "db.t3.medium", "password": "hunter2"},
                    "before_sensitive": {"password": true}, "after_sensitive": {"password": true}}},
                {"address": "aws_nat_gateway.gw", "mode": "managed", "type": "aws_nat_gateway",
                 "change": {"actions": ["no-op"], "before": {}, "after": {}}},
                {"address": "null_resource.n", "mode": "managed", "type": "null_resource",
                 "change": {"actions": ["create"], "before": null, "after": {"triggers": null}}},
                {"address": "aws_s3_bucket.logs", "mode": "managed", "type": "aws_s3_bucket",
                 "change": {"actions": ["create"], "before": null, "after": {"bucket": "bucket-canary"}}},
                {"address": "aws_instance.huge", "mode": "managed", "type": "aws_instance",
                 "change": {"actions": ["create"], "before": null, "after": {"instance_type": "x2iedn.32xlarge"}}},
                {"address": "aws_instance.computed", "mode": "managed", "type": "aws_instance",
                 "change": {"actions": ["create"], "before": null, "after": {},
                    "after_unknown": {"instance_type": true}}},
                {"address": "aws_instance.hidden", "mode": "managed", "type": "aws_instance",
                 "change": {"actions": ["create"], "before": null, "after": {"instance_type": "t3.nano"},
                    "after_sensitive": {"instance_type": true}}},
                {"address": "data.aws_ami.x", "mode": "data", "type": "aws_ami",
                 "change": {"actions": ["read"], "before": null, "after": {"id": "ami-1"}}}
            ]
        })
    }

    #[test]
    fn summary_keeps_only_priced_attributes_and_never_sensitive_values() {
        let s = summarize(&show(), Catalogue::embedded());
        assert_eq!(s.resources.len(), 10, "data sources are left out");
        let text = serde_json::to_string(&s).unwrap();
        for leaked in ["hunter2", "secret-ish", "ami-1", "t3.nano", "bucket-canary"] {
            assert!(!text.contains(leaked), "{leaked} kept in {text}");
        }
        let web = &s.resources[0];
        assert_eq!(web.before["instance_type"], json!("t3.micro"));
        assert_eq!(web.after["instance_type"], json!("t3.large"));
        assert_eq!(web.after.len(), 1);
        let hidden = s
            .resources
            .iter()
            .find(|r| r.address == "aws_instance.hidden")
            .unwrap();
        assert!(hidden.after.is_empty());
        assert_eq!(hidden.sensitive, vec!["instance_type".to_owned()]);
        let computed = s
            .resources
            .iter()
            .find(|r| r.address == "aws_instance.computed")
            .unwrap();
        assert_eq!(computed.unknown, vec!["instance_type".to_owned()]);
        // Round-trips through the stored JSON.
        let back: PlanResources = serde_json::from_str(&text).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn estimate_prices_current_proposed_and_delta_and_lists_unpriced() {
        let e = estimate(
            Catalogue::embedded(),
            &summarize(&show(), Catalogue::embedded()),
        );
        let by = |addr: &str| {
            e.resources
                .iter()
                .find(|r| r.address == addr)
                .unwrap_or_else(|| panic!("{addr} not priced: {e:?}"))
                .amounts
        };
        assert_eq!(
            by("aws_instance.web"),
            Amounts {
                current: 7.59,
                proposed: 60.74,
                delta: 53.15
            }
        );
        assert_eq!(
            by("aws_instance.new[0]"),
            Amounts {
                current: 0.0,
                proposed: 70.08,
                delta: 70.08
            }
        );
        assert_eq!(
            by("aws_instance.old"),
            Amounts {
                current: 15.18,
                proposed: 0.0,
                delta: -15.18
            }
        );
        assert_eq!(
            by("aws_db_instance.db"),
            Amounts {
                current: 12.41,
                proposed: 49.64,
                delta: 37.23
            }
        );
        assert_eq!(
            by("aws_nat_gateway.gw"),
            Amounts {
                current: 32.85,
                proposed: 32.85,
                delta: 0.0
            }
        );
        assert_eq!(by("null_resource.n"), Amounts::default());
        assert_eq!(
            e.total,
            Amounts {
                current: 68.03,
                proposed: 213.31,
                delta: 145.28
            }
        );
        let reasons: BTreeMap<&str, &str> = e
            .unpriced
            .iter()
            .map(|u| (u.address.as_str(), u.reason.as_str()))
            .collect();
        assert_eq!(reasons.len(), 4, "{reasons:?}");
        assert!(reasons["aws_s3_bucket.logs"].contains("no price for aws_s3_bucket"));
        assert!(reasons["aws_instance.huge"].contains("x2iedn.32xlarge"));
        assert!(reasons["aws_instance.computed"].contains("not known until apply"));
        assert!(reasons["aws_instance.hidden"].contains("sensitive"));
        assert!(!e.complete);
        assert_eq!(e.currency, "USD");
    }

    #[test]
    fn provider_free_and_null_only_plans() {
        let empty = summarize(&json!({"format_version": "0.2"}), Catalogue::embedded());
        assert!(empty.resources.is_empty());
        let e = estimate(Catalogue::embedded(), &empty);
        assert!(e.complete && e.resources.is_empty() && e.unpriced.is_empty());
        assert_eq!(e.total, Amounts::default());

        let nulls = json!({"resource_changes": [
            {"address": "null_resource.node[0]", "mode": "managed", "type": "null_resource",
             "change": {"actions": ["delete"], "before": {"id": "1"}, "after": null}},
            {"address": "null_resource.node[1]", "mode": "managed", "type": "null_resource",
             "change": {"actions": ["delete"], "before": {"id": "2"}, "after": null}}
        ]});
        let e = estimate(
            Catalogue::embedded(),
            &summarize(&nulls, Catalogue::embedded()),
        );
        assert_eq!(e.resources.len(), 2);
        assert!(e.complete);
        assert_eq!(e.total, Amounts::default());
    }

    #[test]
    fn whole_object_sensitive_markers_withhold_the_value() {
        let show = json!({"resource_changes": [
            {"address": "aws_instance.a", "mode": "managed", "type": "aws_instance",
             "change": {"actions": ["update"], "before": {"instance_type": "t3.micro"},
                "after": {"instance_type": "t3.small"}, "before_sensitive": true, "after_sensitive": false}}
        ]});
        let s = summarize(&show, Catalogue::embedded());
        assert!(s.resources[0].before.is_empty());
        assert_eq!(s.resources[0].after["instance_type"], json!("t3.small"));
        let e = estimate(Catalogue::embedded(), &s);
        assert!(e.unpriced[0].reason.contains("sensitive"), "{e:?}");
    }
}
