//! Modules with a real terraform (`TAKOSUMI_TERRAFORM_BIN`): `get` downloads them once,
//! `init -get=false` uses exactly those, and the module tree digest pins them. Without
//! `TAKOSUMI_TERRAFORM_BIN` every test here prints "skipped" and passes.

mod common;

use common::{NETWORK_TF, Repo, runner, terraform_from_env};
use takosumi_runner::{Runner, RunnerError, Tool, ToolEnv, Workdir, module_tree_digest};

const MODULE_TF: &str = "variable \"name\" { type = string }\n\
                         output \"greeting\" { value = \"hello-${var.name}\" }\n";

fn root_tf(module_repo: &Repo) -> String {
    format!(
        "module \"local\" {{\n  source = \"./modules/local\"\n}}\n\
         module \"remote\" {{\n  source = \"git::{}?ref=main\"\n  name   = \"x\"\n}}\n\
         output \"o\" {{ value = \"${{module.local.v}}-${{module.remote.greeting}}\" }}\n",
        module_repo.url()
    )
}

async fn checked_out(runner: &Runner, label: &str, repo: &Repo) -> Workdir {
    let wd = runner.workdir(label).unwrap();
    runner
        .checkout(&wd, &repo.url(), "main", None, "infra/app")
        .await
        .unwrap();
    runner.write_backend_override(&wd).unwrap();
    wd
}

/// Two independent downloads of the same module commit digest alike (the `.git` that
/// `get` leaves in a git module does not count); a new commit on the module's branch
/// changes the digest; `init -get=false` downloads nothing and needs `get` first.
#[tokio::test]
async fn get_then_init_without_get_and_a_stable_digest() {
    let Some((bin, cli)) = terraform_from_env() else {
        println!("skipped: TAKOSUMI_TERRAFORM_BIN is not set");
        return;
    };
    let (_base, runner) = runner(bin, cli);
    let module = Repo::new();
    module.write("main.tf", MODULE_TF).commit("module");
    let repo = Repo::new();
    repo.write("infra/app/main.tf", &root_tf(&module))
        .write(
            "infra/app/modules/local/main.tf",
            "output \"v\" { value = \"local\" }\n",
        )
        .commit("app");
    let env = ToolEnv::new();

    // Without `get`, `init -get=false` refuses: it never downloads a module itself.
    let bare = checked_out(&runner, "run_bare", &repo).await;
    match runner.init_without_get(&bare, Tool::Terraform, &env).await {
        Err(RunnerError::ToolFailed { step, output, .. }) => {
            assert_eq!(step, "init");
            assert!(output.contains("Module not installed"), "{output}");
        }
        other => panic!("init -get=false without modules: {other:?}"),
    }

    let first = checked_out(&runner, "run_first", &repo).await;
    let got = runner
        .get_modules(&first, Tool::Terraform, &env)
        .await
        .unwrap();
    assert!(got.output.contains("Downloading"), "{}", got.output);
    assert!(
        first
            .config_dir()
            .join(".terraform/modules/remote/.git")
            .is_dir(),
        "the test relies on get leaving .git behind"
    );
    let digest = module_tree_digest(first.config_dir()).unwrap();
    let init = runner
        .init_without_get(&first, Tool::Terraform, &env)
        .await
        .unwrap();
    assert!(!init.output.contains("Downloading"), "{}", init.output);
    assert_eq!(
        module_tree_digest(first.config_dir()).unwrap(),
        digest,
        "init -get=false changed the module tree"
    );
    runner
        .plan(&first, Tool::Terraform, &env, false)
        .await
        .unwrap();

    // A second, independent download of the same commit.
    let second = checked_out(&runner, "run_second", &repo).await;
    runner
        .get_modules(&second, Tool::Terraform, &env)
        .await
        .unwrap();
    assert_eq!(module_tree_digest(second.config_dir()).unwrap(), digest);

    // The module's branch moves: the same configuration now installs another tree.
    module
        .write("main.tf", &MODULE_TF.replace("hello", "bye"))
        .commit("module v2");
    let third = checked_out(&runner, "run_third", &repo).await;
    runner
        .get_modules(&third, Tool::Terraform, &env)
        .await
        .unwrap();
    assert_ne!(module_tree_digest(third.config_dir()).unwrap(), digest);
}

/// A configuration without modules gets the same digest every time, and `get` leaves the
/// provider lockfile alone (it installs no provider).
#[tokio::test]
async fn no_modules_is_a_stable_digest() {
    let Some((bin, cli)) = terraform_from_env() else {
        println!("skipped: TAKOSUMI_TERRAFORM_BIN is not set");
        return;
    };
    let (_base, runner) = runner(bin, cli);
    let repo = Repo::new();
    repo.write("infra/app/main.tf", NETWORK_TF).commit("app");
    let env = ToolEnv::new();
    let mut digests = Vec::new();
    for label in ["run_a", "run_b"] {
        let wd = checked_out(&runner, label, &repo).await;
        runner
            .get_modules(&wd, Tool::Terraform, &env)
            .await
            .unwrap();
        assert_eq!(runner.read_lockfile(&wd).unwrap(), None);
        digests.push(module_tree_digest(wd.config_dir()).unwrap());
    }
    assert_eq!(digests[0], digests[1]);
}
