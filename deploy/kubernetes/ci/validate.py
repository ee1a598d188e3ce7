#!/usr/bin/env python3
"""Validates rendered manifests (infra/local/validate-deploy.sh runs it in its own venv).

    validate.py TOPOLOGY_JSON KUBERNETES_DIR RENDERED_DIR

(TOPOLOGY_JSON: infra/rabbitmq/topology.json; KUBERNETES_DIR: the deploy/kubernetes that was
rendered, for its secret.example.yaml files.)

For every object of every RENDERED_DIR/*.yaml:
  - core Kubernetes kinds: the Kubernetes OpenAPI schemas, strict (unknown fields refused), with
    `kubernetes-validate` (PyPI), for the oldest Kubernetes the README supports;
  - KEDA kinds (keda.sh/v1alpha1 ScaledJob, ScaledObject, TriggerAuthentication): the pydantic
    models `cloudcoil-models-keda` (PyPI, Apache-2.0) generates from KEDA's own CRD schemas,
    plus a walk that refuses fields those models do not have (the CRDs allow none either); a
    ScaledJob's jobTargetRef is also validated as a batch/v1 Job against the Kubernetes schemas;
  - references: a ScaledObject's target, a trigger's TriggerAuthentication, the Secrets and
    ConfigMaps pods use (a Secret not in the render must be one of the secret.example.yaml
    files, and every key used must be there), every TAKOSUMI_*_FILE pointing into a mounted
    Secret item, and every RabbitMQ queue being one infra/rabbitmq/topology.json declares (or a
    worker pool's `<queue>.<pool>`);
  - Takosumi's rules for the ScaledJobs (one Job per message, each run once to its end) and
    every container (requests, limits, no privilege escalation, all capabilities dropped,
    non-root), and activeDeadlineSeconds above the step time limits the render's ConfigMap
    sets.
It also writes RENDERED_DIR/scaledjob-pods/<render>.yaml: each ScaledJob's Job, so the
misconfiguration scanner (which does not read KEDA's kinds) scans those pods too.
Exits 1 after listing every problem."""

from __future__ import annotations

import base64
import inspect
import json
import pathlib
import posixpath
import sys
import types
import typing

import kubernetes_validate
import pydantic
import yaml
import cloudcoil.models.keda.v1alpha1 as keda

K8S_VERSION = "1.33.0"
KEDA_MODELS = {
    "ScaledJob": keda.ScaledJob,
    "ScaledObject": keda.ScaledObject,
    "TriggerAuthentication": keda.TriggerAuthentication,
}
# shared/runner RunnerConfig defaults (TAKOSUMI_LIMIT_*_SECS), used when the ConfigMap is silent
LIMIT_DEFAULTS = {"CHECKOUT": 300, "INIT": 600, "PLAN": 1800, "APPLY": 7200, "OTHER": 600}
# room past the tool's limits for sealing, uploading and committing (and a canceled apply's grace)
DEADLINE_MARGIN_SECS = 600
# a relay worker refuses to start with any of these set (functions/relay RelaySettings::from_env)
RELAY_FORBIDDEN = {
    "TAKOSUMI_DATABASE_URL",
    "TAKOSUMI_S3_SECRET_KEY",
    "TAKOSUMI_S3_ACCESS_KEY",
    "TAKOSUMI_SEAL_KEY",
    "TAKOSUMI_EVIDENCE_KEY",
}
SECRET_EXAMPLES = ["secret.example.yaml", "examples/relay-pool/secret.example.yaml"]

problems: list[str] = []


def problem(where: str, text: str) -> None:
    problems.append(f"{where}: {text}")


# --- KEDA: unknown fields ------------------------------------------------------------------------
def _models_in(tp) -> list[tuple[str, type]]:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _models_in(typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(tp) for m in _models_in(a)]
    if origin is list:
        return [("list", c) for how, c in _models_in(typing.get_args(tp)[0]) if how == "model"]
    if origin is dict:
        return [("dict", c) for how, c in _models_in(typing.get_args(tp)[1]) if how == "model"]
    if (
        inspect.isclass(tp)
        and issubclass(tp, pydantic.BaseModel)
        and not issubclass(tp, pydantic.RootModel)
    ):
        return [("model", tp)]
    return []


def unknown_fields(cls: type, data, path: str, out: list[str]) -> None:
    if not isinstance(data, dict):
        return
    fields = {(f.alias or name): f for name, f in cls.model_fields.items()}
    for key, value in data.items():
        field = fields.get(key)
        if field is None:
            out.append(f"{path}.{key}: unknown field")
            continue
        for how, sub in _models_in(field.annotation)[:1]:
            if how == "model":
                unknown_fields(sub, value, f"{path}.{key}", out)
            elif how == "list" and isinstance(value, list):
                for i, item in enumerate(value):
                    unknown_fields(sub, item, f"{path}.{key}[{i}]", out)
            elif how == "dict" and isinstance(value, dict):
                for k, item in value.items():
                    unknown_fields(sub, item, f"{path}.{key}.{k}", out)


# --- helpers -------------------------------------------------------------------------------------
def name_of(doc: dict) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def pod_templates(doc: dict):
    """(where, pod template) of every pod the object makes."""
    kind = doc.get("kind")
    spec = doc.get("spec") or {}
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        yield name_of(doc), spec.get("template") or {}
    elif kind == "CronJob":
        yield name_of(doc), ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template") or {}
    elif kind == "ScaledJob":
        yield name_of(doc), (spec.get("jobTargetRef") or {}).get("template") or {}


def secret_keys_known(root: pathlib.Path) -> dict[str, set[str]]:
    known: dict[str, set[str]] = {}
    for rel in SECRET_EXAMPLES:
        for doc in yaml.safe_load_all((root / rel).read_text()):
            if doc and doc.get("kind") == "Secret":
                keys = set((doc.get("stringData") or {}).keys()) | set((doc.get("data") or {}).keys())
                known.setdefault(doc["metadata"]["name"], set()).update(keys)
    return known


def check_render(render: str, docs: list[dict], queues: set[str],
                 examples: dict[str, set[str]], pods_out: pathlib.Path) -> None:
    by_kind: dict[str, dict[str, dict]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    secrets = {
        n: set((d.get("data") or {}).keys()) | set((d.get("stringData") or {}).keys())
        for n, d in by_kind.get("Secret", {}).items()
    }

    def secret_has(where: str, secret: str, key: str) -> None:
        keys = secrets.get(secret, examples.get(secret))
        if keys is None:
            problem(where, f"Secret {secret!r} is neither rendered nor in a secret.example.yaml")
        elif key not in keys:
            problem(where, f"Secret {secret!r} has no key {key!r} (it has {sorted(keys)})")

    for n, d in by_kind.get("Secret", {}).items():
        values = [base64.b64decode(v).decode("utf-8", "replace") for v in (d.get("data") or {}).values()]
        values += [str(v) for v in (d.get("stringData") or {}).values()]
        if any("REPLACE-ME" in v for v in values):
            problem(f"{render}: Secret/{n}", "carries a secret.example.yaml placeholder: the example was rendered")

    settings: dict[str, str] = {}
    for cm in by_kind.get("ConfigMap", {}).values():
        settings.update(cm.get("data") or {})

    synthesized = []
    for doc in docs:
        where = f"{render}: {name_of(doc)}"
        kind = doc["kind"]
        if doc.get("apiVersion") == "keda.sh/v1alpha1":
            model = KEDA_MODELS.get(kind)
            if model is None:
                problem(where, "a KEDA kind this validator has no schema for")
                continue
            checked = doc
            if kind == "ScaledJob" and isinstance((doc.get("spec") or {}).get("jobTargetRef"), dict):
                # The models type a resource Quantity as an int with a pattern (a code
                # generator slip), which refuses every "500m" or "1Gi"; jobTargetRef is a
                # batch/v1 JobSpec in KEDA's CRD, so its pod template is validated below
                # against the Kubernetes schemas instead, strictly.
                checked = json.loads(json.dumps(doc))
                checked["spec"]["jobTargetRef"]["template"] = {"spec": {"containers": [{"name": "x"}]}}
            try:
                model.model_validate(checked)
            except (pydantic.ValidationError, TypeError, KeyError) as e:
                problem(where, f"KEDA schema: {e}")
            # The walk covers the whole object, pod template included: a field KEDA's CRD
            # schema lacks would be pruned by the API server without a word.
            extra: list[str] = []
            unknown_fields(model, doc, kind, extra)
            for e in extra:
                problem(where, f"KEDA schema: {e}")
        else:
            try:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = "/".join(str(p) for p in e.path)
                problem(where, f"Kubernetes {K8S_VERSION} schema: {path}: {e.message}")
            except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as e:
                problem(where, f"no Kubernetes {K8S_VERSION} schema: {e}")

        spec = doc.get("spec") or {}
        # KEDA references and queues
        if kind in ("ScaledJob", "ScaledObject"):
            for i, trig in enumerate(spec.get("triggers") or []):
                auth = (trig.get("authenticationRef") or {}).get("name")
                if auth and auth not in by_kind.get("TriggerAuthentication", {}):
                    problem(where, f"triggers[{i}] names TriggerAuthentication {auth!r}, not rendered")
                if trig.get("type") == "rabbitmq":
                    q = (trig.get("metadata") or {}).get("queueName", "")
                    if q not in queues and not any(q.startswith(f"{b}.") and len(q) > len(b) + 1 for b in queues):
                        problem(where, f"queue {q!r} is not one infra/rabbitmq/topology.json declares")
                    if (trig.get("metadata") or {}).get("protocol") != "amqp":
                        problem(where, f"triggers[{i}]: protocol must be amqp (counts ready messages only)")
        if kind == "ScaledObject":
            target = (spec.get("scaleTargetRef") or {})
            if target.get("kind", "Deployment") != "Deployment" or target.get("name") not in by_kind.get("Deployment", {}):
                problem(where, f"scaleTargetRef {target} is not a rendered Deployment")
        if kind == "TriggerAuthentication":
            for ref in spec.get("secretTargetRef") or []:
                secret_has(where, ref.get("name"), ref.get("key"))
        if kind == "ScaledJob":
            jt = spec.get("jobTargetRef") or {}
            job = {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {
                    "name": doc["metadata"]["name"],
                    "namespace": doc["metadata"].get("namespace", "default"),
                    "labels": doc["metadata"].get("labels", {}),
                },
                "spec": jt,
            }
            synthesized.append(job)
            try:
                kubernetes_validate.validate(job, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = "/".join(str(p) for p in e.path)
                problem(where, f"jobTargetRef as a Kubernetes {K8S_VERSION} Job: {path}: {e.message}")
            # One Job per queued message, run once to its end: what happens to a Run whose pod
            # died is the lease reaper's decision, not Kubernetes's, and neither an upgrade nor a
            # node consolidation may cut an apply off.
            if (spec.get("scalingStrategy") or {}).get("strategy") != "accurate":
                problem(where, "scalingStrategy.strategy must be accurate")
            if (spec.get("rollout") or {}).get("strategy") != "gradual":
                problem(where, "rollout.strategy must be gradual")
            if jt.get("backoffLimit") != 0:
                problem(where, "jobTargetRef.backoffLimit must be 0")
            tpl = jt.get("template") or {}
            pod = tpl.get("spec") or {}
            if pod.get("restartPolicy") != "Never":
                problem(where, "restartPolicy must be Never")
            ann = (tpl.get("metadata") or {}).get("annotations") or {}
            if ann.get("karpenter.sh/do-not-disrupt") != "true":
                problem(where, 'pod annotation karpenter.sh/do-not-disrupt: "true" is missing')
            containers = pod.get("containers") or []
            for c in containers:
                if "--once" not in (c.get("args") or []) + (c.get("command") or []):
                    problem(where, f"container {c.get('name')} does not run --once")
            binary = " ".join((containers[0].get("command") or []) if containers else [])
            step = "APPLY" if "apply" in binary else "PLAN"

            def limit(n: str) -> int:
                return int(settings.get(f"TAKOSUMI_LIMIT_{n}_SECS", LIMIT_DEFAULTS[n]))

            needed = limit("CHECKOUT") + limit("INIT") + limit(step) + limit("OTHER") + DEADLINE_MARGIN_SECS
            deadline = jt.get("activeDeadlineSeconds")
            if not isinstance(deadline, int) or deadline < needed:
                problem(where, f"activeDeadlineSeconds {deadline} must be at least {needed} "
                               f"(checkout + init + {step.lower()} + other limits + {DEADLINE_MARGIN_SECS} s)")
            grace = pod.get("terminationGracePeriodSeconds", 30)
            if isinstance(deadline, int) and grace >= deadline:
                problem(where, "terminationGracePeriodSeconds must be below activeDeadlineSeconds")
            if step == "APPLY" and grace < limit("APPLY"):
                problem(where, "an apply pod's terminationGracePeriodSeconds must cover the apply limit "
                               "(SIGTERM lets the apply finish)")

        # pods: containers, secrets, configmaps, *_FILE settings
        for pwhere, tpl in pod_templates(doc):
            pwhere = f"{render}: {pwhere}"
            pod = tpl.get("spec") or {}
            psc = pod.get("securityContext") or {}
            volumes = {v.get("name"): v for v in pod.get("volumes") or []}
            for v in volumes.values():
                if "secret" in v:
                    for item in v["secret"].get("items") or []:
                        secret_has(pwhere, v["secret"].get("secretName"), item.get("key"))
            for c in (pod.get("containers") or []) + (pod.get("initContainers") or []):
                cwhere = f"{pwhere} container {c.get('name')}"
                res = c.get("resources") or {}
                for part in ("requests", "limits"):
                    for r in ("cpu", "memory"):
                        if r not in (res.get(part) or {}):
                            problem(cwhere, f"resources.{part}.{r} is not set")
                sc = c.get("securityContext") or {}
                if sc.get("allowPrivilegeEscalation") is not False:
                    problem(cwhere, "securityContext.allowPrivilegeEscalation must be false")
                if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
                    problem(cwhere, "securityContext.capabilities.drop must include ALL")
                if (sc.get("capabilities") or {}).get("add"):
                    problem(cwhere, "no capability may be added")
                if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
                    problem(cwhere, "runAsNonRoot must be true")
                if "takosumi-relay" in " ".join(c.get("command") or []):
                    names = {e.get("name") for e in c.get("env") or []}
                    for n in sorted(names & (RELAY_FORBIDDEN | {f + "_FILE" for f in RELAY_FORBIDDEN})):
                        problem(cwhere, f"{n} is set: a relay worker refuses to start with it")
                    if c.get("envFrom"):
                        problem(cwhere, "a relay worker takes no envFrom (the control plane's settings carry S3 names)")
                for src in c.get("envFrom") or []:
                    ref = (src.get("configMapRef") or {}).get("name")
                    if ref and ref not in by_kind.get("ConfigMap", {}):
                        problem(cwhere, f"envFrom ConfigMap {ref!r} is not rendered")
                mounts = c.get("volumeMounts") or []
                for m in mounts:
                    if m.get("name") not in volumes:
                        problem(cwhere, f"volumeMount {m.get('name')!r} has no volume")
                for env in c.get("env") or []:
                    n, val = env.get("name", ""), env.get("value")
                    if not (n.startswith("TAKOSUMI_") and n.endswith("_FILE")):
                        continue
                    if n[: -len("_FILE")] in {e.get("name") for e in c.get("env") or []}:
                        problem(cwhere, f"{n} and {n[:-5]} are both set (the process refuses that)")
                    found = False
                    for m in mounts:
                        mp = m.get("mountPath", "").rstrip("/")
                        if val and posixpath.dirname(val) == mp:
                            vol = volumes.get(m.get("name")) or {}
                            items = (vol.get("secret") or {}).get("items")
                            if "secret" in vol and (items is None or posixpath.basename(val) in {i.get("path") for i in items}):
                                found = True
                    if not found:
                        problem(cwhere, f"{n}={val} is not a file of a mounted Secret")
    if synthesized:
        pods_out.mkdir(parents=True, exist_ok=True)
        (pods_out / f"{render}.yaml").write_text(yaml.safe_dump_all(synthesized, sort_keys=False))


def main() -> int:
    topology, kube_dir, rendered = (pathlib.Path(a) for a in sys.argv[1:4])
    queues = set(json.loads(topology.read_text())["queues"])
    examples = secret_keys_known(kube_dir)
    files = sorted(rendered.glob("*.yaml"))
    if not files:
        print("validate: nothing rendered", file=sys.stderr)
        return 1
    count = 0
    for f in files:
        docs = [d for d in yaml.safe_load_all(f.read_text()) if d]
        for d in docs:
            if not isinstance(d, dict) or "kind" not in d or "metadata" not in d:
                problem(f.stem, f"not a Kubernetes object: {str(d)[:80]}")
        docs = [d for d in docs if isinstance(d, dict) and "kind" in d and "metadata" in d]
        count += len(docs)
        check_render(f.stem, docs, queues, examples, rendered / "scaledjob-pods")
    for p in problems:
        print(f"validate: {p}", file=sys.stderr)
    print(f"validate: {count} objects in {len(files)} renders, Kubernetes {K8S_VERSION} "
          f"(strict) and KEDA schemas: {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
