// The dashboard in a real browser (Debian's Chromium, driven by playwright-core; started by
// tests/tests/dashboard.rs against the real stack, which passes everything in the
// environment). Exits non-zero, saying which step failed, when anything is not as the
// issue says; prints one JSON line of what it saw for the Rust side to check against
// Postgres.
"use strict";

const { chromium } = require(process.env.PLAYWRIGHT_CORE || "playwright-core");
const fs = require("fs");
const path = require("path");

const env = (k) => {
  const v = process.env[k];
  if (!v) throw new Error(`${k} is not set`);
  return v;
};
const BASE = env("BASE_URL");
const CAP = env("CAPSULE_ID");
const NULL_CAP = env("NULL_CAPSULE_ID");
const CREDENTIAL = env("CREDENTIAL_CANARY");
const CANARY = env("CANARY");
const CANARY_RUN = env("CANARY_RUN_ID");
const SHOTS = env("SCREENSHOT_DIR");
const TOKENS = {
  operator: env("OPERATOR_TOKEN"),
  approver: env("APPROVER_TOKEN"),
  viewer: env("VIEWER_TOKEN"),
};

const seen = { pages: 0, streams: 0, steps: [] };
let page;

function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`);
}

async function shot(name) {
  await page.screenshot({ path: path.join(SHOTS, `${name}.png`), fullPage: true });
}

/// Every page the test sees is swept for the canary and for any token.
async function sweep(where) {
  const html = await page.content();
  seen.pages += 1;
  check(!html.includes(CANARY), `the canary appears on ${where}`);
  check(!html.includes(CREDENTIAL), `the credential canary appears on ${where}`);
  for (const [role, t] of Object.entries(TOKENS)) {
    check(!html.includes(t), `the ${role} token appears on ${where}`);
  }
  return html;
}

async function step(name, f) {
  process.stderr.write(`dashboard: ${name}\n`);
  seen.steps.push(name);
  try {
    await f();
  } catch (e) {
    try {
      await shot(`failed-${seen.steps.length}`);
    } catch (_) {}
    e.message = `${name}: ${e.message} (at ${page && page.url()})`;
    throw e;
  }
}

async function signIn(role) {
  await page.goto(`${BASE}/`);
  check(page.url().includes("/sign-in"), "an unsigned visit goes to the sign-in page");
  await page.fill("#token", TOKENS[role]);
  await Promise.all([page.waitForURL(`${BASE}/`), page.click("button[type=submit]")]);
  const who = await page.textContent("[data-testid=who]");
  check(who.includes(role), `signed in as ${role} (${who})`);
  const cookies = await page.context().cookies();
  const session = cookies.find((c) => c.name === "takosumi_session");
  check(session, "a session cookie was set");
  check(session.httpOnly, "the session cookie is HttpOnly");
  check(session.sameSite === "Strict", `the session cookie is SameSite=Strict (${session.sameSite})`);
  for (const c of cookies) {
    for (const t of Object.values(TOKENS)) check(!c.value.includes(t), "a cookie holds a token");
  }
  const stored = await page.evaluate(() => JSON.stringify({ ...localStorage }) + JSON.stringify({ ...sessionStorage }));
  for (const t of Object.values(TOKENS)) check(!stored.includes(t), "browser storage holds a token");
  await sweep("the Workspaces page");
}

async function signOut() {
  await Promise.all([page.waitForURL(/\/sign-in/), page.click("header form button")]);
}

/// Reloads `url` until `selector` shows (the page itself reloads when its Run settles).
async function until(url, selector, what, seconds = 120) {
  const deadline = Date.now() + seconds * 1000;
  for (;;) {
    if (!page.url().startsWith(url)) await page.goto(url);
    try {
      await page.waitForSelector(selector, { timeout: 3000 });
      // A page of a settled Run follows no stream and reloads no more.
      await page.waitForSelector("#log[data-terminal=true], #log:not([data-stream])", { timeout: 100 }).catch(() => {});
      await page.waitForLoadState("load");
      return;
    } catch (_) {}
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await page.goto(url);
  }
}

async function status() {
  return (await page.textContent("h1 [data-testid=status]")).trim();
}

async function main() {
  fs.mkdirSync(SHOTS, { recursive: true });
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    args: [
      "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync",
    ],
  });
  const context = await browser.newContext();
  page = await context.newPage();
  const cspViolations = [];
  page.on("console", (m) => {
    if (m.type() === "error" && /Content Security Policy/i.test(m.text())) cspViolations.push(m.text());
  });
  const out = {};

  await step("the pages carry a strict CSP", async () => {
    const r = await page.goto(`${BASE}/sign-in`);
    const csp = r.headers()["content-security-policy"] || "";
    check(csp.includes("default-src 'none'") && csp.includes("script-src 'self'"), `CSP: ${csp}`);
    check(!csp.includes("unsafe-inline"), "the CSP allows inline script or style");
    check((r.headers()["x-frame-options"] || "") === "DENY", "frames are denied");
  });

  await step("a wrong token is refused", async () => {
    await page.fill("#token", "tks_not_a_token");
    await page.click("button[type=submit]");
    await page.waitForSelector("[data-testid=problem]");
    check(page.url().includes("/sign-in"), "still on the sign-in page");
  });

  await step("operator signs in", async () => signIn("operator"));

  await step("install the network example from its Capsule page", async () => {
    await page.goto(`${BASE}/capsules/${CAP}`);
    await sweep("the Capsule page");
    await shot("capsule");
    await Promise.all([page.waitForURL(/\/runs\/run_/), page.click("button[data-action=Install]")]);
    out.installPlanRun = page.url().split("/runs/")[1];
    // The page follows the stream while the plan runs, then reloads when it settles.
    await until(page.url(), "[data-testid=followed-by] a", "the install's apply Run");
    await sweep("the install plan's Run page");
    const diff = await page.textContent("#plan [data-testid=output-changes]");
    check(diff.includes("vpc") && diff.includes("vpc-eu"), `the plan's diff shows vpc = vpc-eu: ${diff}`);
    await shot("run-plan");
    await Promise.all([page.waitForURL(/\/runs\/run_/), page.click("[data-testid=followed-by] a")]);
    out.installApplyRun = page.url().split("/runs/")[1];
    await until(page.url(), "[data-testid=outputs]", "the apply's outputs");
    check((await status()) === "applied", `the install applied (${await status()})`);
    const outputs = await page.textContent("[data-testid=outputs]");
    check(outputs.includes("vpc") && outputs.includes("vpc-eu"), `outputs show vpc = vpc-eu: ${outputs}`);
    // The statement is signed just after the Run ends: if the page came first, its
    // evidence line fetches itself until the statement is there (no reload here).
    out.evidenceAwaited = (await page.textContent("#evidence")).includes("Being signed");
    await page.waitForSelector("[data-testid=evidence]");
    const ev = await page.textContent("[data-testid=evidence]");
    check(ev.includes("Verified"), `the evidence verifies: ${ev}`);
    await sweep("the install apply's Run page");
    await shot("run-apply");
  });

  await step("the Workspace page lists the Capsule and its Runs", async () => {
    await page.click(".crumbs a >> nth=0");
    await page.waitForSelector("table.capsules");
    const state = await page.textContent("tr[data-capsule] [data-testid=capsule-state]");
    check(state.trim() === "ok", `the Capsule is ok (${state})`);
    check((await page.locator("table.runs tbody tr").count()) >= 2, "the history lists the Runs");
    // The filters are htmx: only the history is swapped, and the URL follows.
    await page.selectOption("select[name=kind]", "apply");
    await page.click("form.filters button");
    await page.waitForURL(/kind=apply/);
    await page.waitForFunction(() =>
      [...document.querySelectorAll("table.runs tbody tr td:nth-child(2)")].every((td) => td.textContent === "apply"));
    await sweep("the Workspace page");
    await shot("workspace");
  });

  let held;
  await step("a destroying plan is held by maxDestroy: 0", async () => {
    await page.goto(`${BASE}/capsules/${NULL_CAP}`);
    await Promise.all([page.waitForURL(/\/runs\/run_/), page.click("button[data-action=Destroy]")]);
    await until(page.url(), "button[data-action=Apply]", "the destroy plan to be planned");
    await sweep("the destroy plan's Run page");
    check((await page.textContent("#plan")).includes("destroy"), "the diff shows the destruction");
    await Promise.all([page.waitForURL(/\/runs\/run_/), page.click("button[data-action=Apply]")]);
    held = page.url().split("/runs/")[1];
    out.heldRun = held;
    await until(page.url(), "[data-testid=hold]", "the hold");
    const hold = await page.textContent("[data-testid=hold]");
    check(hold.includes("max_destroy"), `held for max_destroy: ${hold}`);
    check((await page.locator("button[data-action=Approve]").count()) === 0, "the requester sees no Approve");
    await sweep("the held Run page");
    await shot("run-held");
    await signOut();
  });

  await step("a viewer sees no Approve and a forged approval is refused", async () => {
    await signIn("viewer");
    await page.goto(`${BASE}/runs/${held}`);
    await page.waitForSelector("[data-testid=hold]");
    check((await page.locator("button[data-action=Approve]").count()) === 0, "a viewer sees an Approve button");
    check((await page.locator("button[data-action=Apply], button[data-action=Cancel]").count()) === 0, "a viewer sees actions");
    const csrf = await page.getAttribute("header form input[name=csrf]", "value");
    const forged = await page.request.post(`${BASE}/runs/${held}/approve`, {
      form: { csrf, nonce: "forged-1" }, maxRedirects: 0,
    });
    check(forged.status() === 403, `a viewer's forged approval is refused (${forged.status()})`);
    const noCsrf = await page.request.post(`${BASE}/runs/${held}/approve`, { form: { nonce: "x" }, maxRedirects: 0 });
    check(noCsrf.status() === 403, `a CSRF-less POST is refused (${noCsrf.status()})`);
    check((await noCsrf.text()).includes("CSRF"), "the refusal says why");
    const crossSite = await page.request.post(`${BASE}/runs/${held}/cancel`, {
      form: { csrf, nonce: "x" }, headers: { Origin: "http://evil.example" }, maxRedirects: 0,
    });
    check(crossSite.status() === 403, `a cross-site POST is refused (${crossSite.status()})`);
    out.viewerForgedStatus = forged.status();
    await sweep("the held Run page as a viewer");
    await signOut();
  });

  await step("a second user approves on the Run page and it applies", async () => {
    await signIn("approver");
    await page.goto(`${BASE}/runs/${held}`);
    const digest = await page.textContent("[data-testid=approve-digest]");
    check(digest.trim().length === 16, `the Approve button shows the plan digest (${digest})`);
    out.approvedDigestPrefix = digest.trim();
    await page.click("button[data-action=Approve]");
    await until(`${BASE}/runs/${held}`, "h1 .status-applied", "the approved destroy to apply", 120);
    const approvals = await page.textContent("body");
    check(approvals.includes("approver"), "the approval is listed");
    await sweep("the approved Run page");
    await shot("run-approved");
  });

  await step("the canary appears nowhere, not in the stream either", async () => {
    await page.goto(`${BASE}/runs/${CANARY_RUN}`);
    const html = await sweep("the canary Run's page");
    check(html.includes("(sensitive)") || html.includes("***"), "the canary plan's diff is shown masked");
    for (const run of [CANARY_RUN, out.installApplyRun, held]) {
      const r = await page.request.get(`${BASE}/runs/${run}/stream`);
      const body = await r.text();
      seen.streams += 1;
      check(r.status() === 200, `the stream of ${run} answers (${r.status()})`);
      check((r.headers()["content-type"] || "").startsWith("text/event-stream"), "it is an event stream");
      check(body.includes("event: end"), `the stream of settled ${run} ends`);
      check(!body.includes(CANARY) && !body.includes(CREDENTIAL), `a canary is in the stream of ${run}`);
    }
    await shot("run-canary");
  });

  check(cspViolations.length === 0, `CSP violations: ${cspViolations.join("; ")}`);
  await browser.close();
  out.seen = seen;
  process.stdout.write(JSON.stringify(out) + "\n");
}

main().catch((e) => {
  process.stderr.write(`dashboard test FAILED: ${e.stack || e}\n`);
  process.exit(1);
});
