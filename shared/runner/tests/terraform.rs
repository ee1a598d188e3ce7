//! The runner with a real terraform: `TAKOSUMI_TERRAFORM_BIN` (the project tests with
//! terraform; OpenTofu takes the same arguments) and, for provider tests,
//! `TAKOSUMI_TF_CLI_CONFIG` (a CLI config with an offline mirror of hashicorp/null 2.1.2).
//! Without `TAKOSUMI_TERRAFORM_BIN` every test here prints "skipped" and passes.

mod common;

use std::fs;

use common::{NETWORK_TF, Repo, runner, terraform_from_env};
use serde_json::{Value, json};
use takosumi_runner::{
    Runner, RunnerError, Tool, ToolEnv, Workdir, count_changes, is_stale_plan, public_outputs,
};

fn vars(v: Value) -> ToolEnv {
    ToolEnv::new()
        .with_variables(v.as_object().unwrap())
        .unwrap()
}

/// Checkout, override, optional state, init: a run directory ready to plan or apply.
async fn prepared(
    runner: &Runner,
    label: &str,
    repo: &Repo,
    commit: Option<&str>,
    state: Option<&[u8]>,
    env: &ToolEnv,
) -> Workdir {
    let wd = runner.workdir(label).unwrap();
    runner
        .checkout(&wd, &repo.url(), "main", commit, "infra/network")
        .await
        .unwrap();
    runner.write_backend_override(&wd).unwrap();
    if let Some(state) = state {
        runner.restore_state(&wd, state).unwrap();
    }
    let out = runner.init(&wd, Tool::Terraform, env).await.unwrap();
    assert_eq!(out.exit_code, 0);
    wd
}

#[tokio::test]
async fn plan_apply_restore_and_stale_plans() {
    let Some((bin, cli)) = terraform_from_env() else {
        println!("skipped: TAKOSUMI_TERRAFORM_BIN is not set");
        return;
    };
    let (_base, runner) = runner(bin, cli);
    let repo = Repo::new();
    repo.write("infra/network/main.tf", NETWORK_TF)
        // A backend the machine cannot reach: init only works if the override wins.
        .write(
            "infra/network/backend.tf",
            "terraform {\n  backend \"s3\" {\n    bucket = \"nowhere\"\n    key    = \"x\"\n    region = \"us-east-1\"\n  }\n}\n",
        )
        // Left behind by someone's laptop: must not be trusted.
        .write(
            "infra/network/.terraform/terraform.tfstate",
            "{\"version\":3,\"backend\":{\"type\":\"s3\",\"config\":{\"bucket\":\"nowhere\"}}}",
        );
    let commit = repo.commit("network");

    let version = runner
        .version(Tool::Terraform, &ToolEnv::new())
        .await
        .unwrap();
    assert!(version["terraform_version"].as_str().is_some(), "{version}");

    // Plan in one run directory.
    let eu = vars(json!({"region": "eu"}));
    let wd = runner.workdir("run_plan1").unwrap();
    let snapshot = runner
        .checkout(&wd, &repo.url(), "main", None, "infra/network")
        .await
        .unwrap();
    assert_eq!(snapshot.commit, commit);
    assert!(
        !wd.config_dir()
            .join(".terraform/terraform.tfstate")
            .exists()
    );
    runner.write_backend_override(&wd).unwrap();
    runner.init(&wd, Tool::Terraform, &eu).await.unwrap();
    assert_eq!(
        runner.read_lockfile(&wd).unwrap(),
        None,
        "provider-free: no lockfile"
    );
    let out = runner.plan(&wd, Tool::Terraform, &eu, false).await.unwrap();
    assert_eq!(out.exit_code, 0);
    assert!(out.output.contains("vpc-eu"), "{}", out.output);
    let show = runner.show_json(&wd, Tool::Terraform, &eu).await.unwrap();
    assert!(
        count_changes(&show).is_empty(),
        "outputs only: no resource changes"
    );
    let plan = runner.read_plan_file(&wd).unwrap();
    assert!(plan.starts_with(b"PK"), "a plan file is a zip");

    // Apply it in another run directory, as the apply step does: the plan's backend
    // path is relative, so the state lands in *this* run directory.
    let wd_apply = prepared(
        &runner,
        "run_apply1",
        &repo,
        Some(&snapshot.commit),
        None,
        &eu,
    )
    .await;
    drop(wd);
    runner.write_plan_file(&wd_apply, &plan).unwrap();
    let out = runner.apply(&wd_apply, Tool::Terraform, &eu).await.unwrap();
    assert_eq!(out.exit_code, 0, "{}", out.output);
    runner.wipe_plan_file(&wd_apply).unwrap();
    let state = runner
        .read_state(&wd_apply)
        .unwrap()
        .expect("apply wrote state");
    let outputs = takosumi_runner::state_outputs(&state).unwrap();
    assert_eq!(public_outputs(&outputs)["vpc"], "vpc-eu");
    assert!(String::from_utf8_lossy(&state).contains("vpc-eu"));
    assert!(!wd_apply.config_dir().join("terraform.tfstate").exists());
    drop(wd_apply);

    // Two plans from that state; the first applied makes the second stale.
    let us = vars(json!({"region": "us"}));
    let fr = vars(json!({"region": "fr"}));
    let wd_us = prepared(&runner, "run_us", &repo, None, Some(&state), &us).await;
    runner
        .plan(&wd_us, Tool::Terraform, &us, false)
        .await
        .unwrap();
    let wd_fr = prepared(&runner, "run_fr", &repo, None, Some(&state), &fr).await;
    runner
        .plan(&wd_fr, Tool::Terraform, &fr, false)
        .await
        .unwrap();
    let out = runner.apply(&wd_fr, Tool::Terraform, &fr).await.unwrap();
    assert_eq!(out.exit_code, 0, "{}", out.output);
    let state_fr = runner.read_state(&wd_fr).unwrap().unwrap();
    runner.restore_state(&wd_us, &state_fr).unwrap();
    let out = runner.apply(&wd_us, Tool::Terraform, &us).await.unwrap();
    assert_ne!(out.exit_code, 0);
    assert!(is_stale_plan(&out), "{}", out.stderr);
    assert_eq!(
        runner.read_state(&wd_us).unwrap().unwrap(),
        state_fr,
        "a stale apply leaves state untouched"
    );

    // A missing variable fails plan with the tool's own message, not the values.
    let wd_none = prepared(
        &runner,
        "run_novar",
        &repo,
        None,
        Some(&state_fr),
        &ToolEnv::new(),
    )
    .await;
    let err = runner
        .plan(&wd_none, Tool::Terraform, &ToolEnv::new(), false)
        .await
        .unwrap_err();
    let RunnerError::ToolFailed { step, output, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(*step, "plan");
    assert!(output.contains("region"), "{output}");
}

/// With the offline null provider: lockfile capture and real resource changes.
#[tokio::test]
async fn resources_with_the_null_provider() {
    let Some((bin, cli)) = terraform_from_env() else {
        println!("skipped: TAKOSUMI_TERRAFORM_BIN is not set");
        return;
    };
    if cli.is_none() {
        println!("skipped: TAKOSUMI_TF_CLI_CONFIG (offline provider mirror) is not set");
        return;
    }
    let (_base, runner) = runner(bin, cli);
    let repo = Repo::new();
    repo.write(
        "infra/network/main.tf",
        "variable \"region\" { type = string }\n\
         resource \"null_resource\" \"vpc\" {\n  triggers = { region = var.region }\n}\n\
         resource \"null_resource\" \"fixed\" {}\n\
         output \"vpc\" { value = \"vpc-${var.region}\" }\n",
    );
    repo.commit("null");

    let eu = vars(json!({"region": "eu"}));
    let wd = prepared(&runner, "run_null1", &repo, None, None, &eu).await;
    let lock = runner
        .read_lockfile(&wd)
        .unwrap()
        .expect("init writes a lockfile");
    assert!(String::from_utf8_lossy(&lock).contains("hashicorp/null"));
    runner.plan(&wd, Tool::Terraform, &eu, false).await.unwrap();
    let show = runner.show_json(&wd, Tool::Terraform, &eu).await.unwrap();
    let c = count_changes(&show);
    assert_eq!((c.add, c.change, c.destroy), (2, 0, 0));
    let out = runner.apply(&wd, Tool::Terraform, &eu).await.unwrap();
    assert_eq!(out.exit_code, 0, "{}", out.output);
    let state = runner.read_state(&wd).unwrap().unwrap();

    // A changed trigger replaces one resource; the other is a no-op.
    let us = vars(json!({"region": "us"}));
    let wd2 = prepared(&runner, "run_null2", &repo, None, Some(&state), &us).await;
    runner
        .plan(&wd2, Tool::Terraform, &us, false)
        .await
        .unwrap();
    let c = count_changes(&runner.show_json(&wd2, Tool::Terraform, &us).await.unwrap());
    assert_eq!((c.add, c.change, c.destroy), (1, 0, 1));

    // A destroy plan.
    runner.plan(&wd2, Tool::Terraform, &us, true).await.unwrap();
    let c = count_changes(&runner.show_json(&wd2, Tool::Terraform, &us).await.unwrap());
    assert_eq!((c.add, c.change, c.destroy), (0, 0, 2));
    assert!(fs::metadata(wd2.plan_path()).unwrap().len() > 0);
}
