"""Static checks of infra/: no Docker engine, Kubernetes cluster or Terraform provider download is available here.

Every file is parsed and its content checked against what the pipeline needs: pinned images, the services of the
stack, GPU reservations, single-threaded Dask workers, the work pool, the deployments and their schedule, and
credentials that only ever come from the environment or from secrets.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import hcl2
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
COMPOSE_FILE = INFRA / "docker-compose.yml"
DOCKERFILE = INFRA / "docker" / "Dockerfile"
TERRAFORM = INFRA / "terraform"
HELM = INFRA / "helm"

POOL = "influence-pool"
ENTRYPOINT = "flows/influence_run.py:influence_run"
SCHEDULER_ADDRESS = "tcp://dask-scheduler:8786"
TORCH = "torch==2.13.0"

# `${VAR}`, `${VAR:?message}` or `${VAR?message}`: a value compose takes from the environment, with no default.
ENV_ONLY = re.compile(r"^\$\{[A-Za-z_][A-Za-z0-9_]*(?::?\?[^}]*)?\}$")
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY|API_KEY|ROOT_USER", re.IGNORECASE)


# ---------------------------------------------------------------------------------------------- helpers
def image_is_pinned(ref: str) -> bool:
    """An image reference with a digest, or an explicit tag that is not `latest` and not left to interpolation."""
    if not isinstance(ref, str) or not ref or "$" in ref:
        return False
    if "@" in ref:
        return re.fullmatch(r"[^@\s]+@sha256:[0-9a-f]{64}", ref) is not None
    last = ref.rsplit("/", 1)[-1]  # a registry's port (host:5000/name) is not a tag
    if ":" not in last:
        return False
    tag = last.split(":", 1)[1]
    return bool(re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", tag)) and tag.lower() != "latest"


def as_list(command: Any) -> list[str]:
    return command.split() if isinstance(command, str) else [str(part) for part in command or []]


def flag_value(args: list[str], flag: str) -> str | None:
    """The value after `flag` (also `flag=value`) in an argument list."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def env_dict(environment: Any) -> dict[str, str]:
    if isinstance(environment, dict):
        return {str(k): "" if v is None else str(v) for k, v in environment.items()}
    return dict(item.split("=", 1) if "=" in item else (item, "") for item in environment or [])


def flatten(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from flatten(item)
    else:
        yield value


def walk(node: Any) -> Iterator[dict[str, Any]]:
    """Every mapping in a YAML document."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


def test_pin_check_rejects_unpinned_references() -> None:
    for ref in ["postgres", "postgres:latest", "localhost:5000/img", "img:${TAG}", "img@sha256:abc", ""]:
        assert not image_is_pinned(ref), ref
    for ref in ["postgres:16.4-alpine", "localhost:5000/img:1.2", "img@sha256:" + "a" * 64]:
        assert image_is_pinned(ref), ref


# ---------------------------------------------------------------------------------------------- compose
@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(doc, dict) and isinstance(doc.get("services"), dict)
    return doc


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def service_by_command(services: dict[str, dict[str, Any]], *words: str) -> tuple[str, dict[str, Any]]:
    found = [(name, s) for name, s in services.items() if all(w in as_list(s.get("command")) for w in words)]
    assert len(found) == 1, f"expected one service running {' '.join(words)}, found {[n for n, _ in found]}"
    return found[0]


def test_compose_has_the_stack(services: dict[str, dict[str, Any]]) -> None:
    for name in ["postgres", "prefect-server", "dask-scheduler", "prefect-worker"]:
        assert name in services, name
    stores = [n for n, s in services.items() if str(s.get("image", "")).split(":")[0].endswith("minio/minio")]
    assert stores, "no S3-compatible store (MinIO) service"
    service_by_command(services, "cuda", "worker")
    assert services["postgres"]["image"].startswith("postgres:16")
    assert services["prefect-server"]["image"] == "prefecthq/prefect:3.8.8-python3.11"


def test_compose_images_are_pinned(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        assert "image" in service, f"{name}: no image (a build needs a pinned image name too)"
        assert image_is_pinned(service["image"]), f"{name}: {service['image']!r} is not pinned"


def dockerfile_stages() -> tuple[list[tuple[str, str | None]], dict[str, list[str]]]:
    """FROM lines as (image, stage name) and the instructions of each stage (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    froms: list[tuple[str, str | None]] = []
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?\s*$", line, re.IGNORECASE)
        if match:
            froms.append((match.group(1), match.group(2)))
            current = stages.setdefault(match.group(2) or f"stage{len(froms) - 1}", [])
        else:
            current.append(line)
    return froms, stages


def test_dockerfile_bases_are_pinned() -> None:
    froms, _ = dockerfile_stages()
    assert froms, "no FROM line"
    names: set[str] = set()
    external = []
    for image, stage in froms:
        if image not in names:
            assert image_is_pinned(image), f"FROM {image} is not pinned"
            external.append(image)
        if stage:
            names.add(stage)
    assert external and all(re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", image) for image in external), external


def test_compose_builds_use_the_dockerfile(services: dict[str, dict[str, Any]]) -> None:
    _, stages = dockerfile_stages()
    builders = {name: s for name, s in services.items() if "build" in s}
    assert builders, "no service builds the project image"
    for name, service in builders.items():
        build = service["build"]
        assert (COMPOSE_FILE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE.resolve(), name
        assert build.get("target") in stages, f"{name}: build target {build.get('target')!r} is not a Dockerfile stage"
    # every service on a project image builds it (or compose would try to pull it from a registry)
    for name, service in services.items():
        if str(service["image"]).startswith("influence-pipeline:"):
            assert name in builders, name
    cuda_name, cuda = service_by_command(services, "cuda", "worker")
    assert cuda["build"]["target"] == "gpu", cuda_name


def test_dockerfile_installs_torch_before_the_project() -> None:
    _, stages = dockerfile_stages()
    project_stages = {name: lines for name, lines in stages.items() if any(re.search(r"pip install .*\"?\.(\[|\"|\s|$)", l) for l in lines)}
    assert {"cpu", "gpu"} <= set(project_stages), sorted(stages)
    for name, lines in project_stages.items():
        torch_at = [i for i, l in enumerate(lines) if l.startswith("RUN") and "pip install" in l and TORCH in l]
        project_at = [i for i, l in enumerate(lines) if l.startswith("RUN") and re.search(r"pip install (\S+ )*\"?\.(\[[a-z,]+\])?\"?(\s|$)", l)]
        assert torch_at and project_at, f"stage {name}: torch or the project is not installed"
        assert torch_at[0] < project_at[0], f"stage {name}: the project is installed before {TORCH}"
    assert "download.pytorch.org/whl/cpu" in next(l for l in project_stages["cpu"] if TORCH in l)
    assert any('".[gpu]"' in l or ".[gpu]" in l for l in project_stages["gpu"]), "gpu stage does not install the gpu extra"


def test_dask_cuda_worker_reserves_gpus(services: dict[str, dict[str, Any]]) -> None:
    name, service = service_by_command(services, "cuda", "worker")
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    gpu = [d for d in devices if "gpu" in list(flatten(d.get("capabilities")))]
    assert gpu, f"{name}: no device reservation with the gpu capability"
    assert all(d.get("driver") == "nvidia" for d in gpu), name


def test_dask_workers_are_single_threaded_and_reach_the_scheduler(services: dict[str, dict[str, Any]]) -> None:
    workers = {n: s for n, s in services.items() if "worker" in as_list(s.get("command")) and "dask" in as_list(s.get("command"))}
    assert len(workers) >= 1 and any("cuda" in as_list(s["command"]) for s in workers.values())
    for name, service in workers.items():
        args = as_list(service["command"])
        assert flag_value(args, "--nthreads") == "1", f"{name}: workers must be single-threaded"
        assert SCHEDULER_ADDRESS in args, name
        env = env_dict(service.get("environment"))
        assert ENV_ONLY.match(env.get("AWS_SECRET_ACCESS_KEY", "")), f"{name}: workers write to S3 and need credentials"
    scheduler = services["dask-scheduler"]
    assert flag_value(as_list(scheduler["command"]), "--port") == "8786"
    assert any(str(p).endswith("8786") for p in scheduler.get("ports", []))


def test_prefect_worker(services: dict[str, dict[str, Any]]) -> None:
    worker = services["prefect-worker"]
    args = as_list(worker["command"])
    assert args[:3] == ["prefect", "worker", "start"], args
    assert flag_value(args, "--pool") == POOL
    assert flag_value(args, "--type") == "process"
    env = env_dict(worker["environment"])
    assert env.get("PREFECT_API_URL") == "http://prefect-server:4200/api"
    for key in ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]:
        assert ENV_ONLY.match(env.get(key, "")), f"prefect-worker {key}={env.get(key)!r} is not taken from the environment"
    assert "AWS_DEFAULT_REGION" in env
    assert worker["depends_on"]["prefect-server"]["condition"] == "service_healthy"


def test_no_literal_secrets_in_compose(services: dict[str, dict[str, Any]]) -> None:
    checked = 0
    for name, service in services.items():
        for key, value in env_dict(service.get("environment")).items():
            if SECRET_NAME.search(key):
                checked += 1
                assert ENV_ONLY.match(value), f"{name}: {key} must come from the environment (${{VAR:?}}), not {value!r}"
    assert checked >= 6


def test_prefect_server_uses_postgres(services: dict[str, dict[str, Any]]) -> None:
    server = services["prefect-server"]
    env = env_dict(server["environment"])
    url = env["PREFECT_API_DATABASE_CONNECTION_URL"]
    match = re.fullmatch(r"postgresql\+asyncpg://(?P<user>[^:@]+):(?P<password>.+)@postgres:5432/(?P<db>\w+)", url)
    assert match, url
    assert ENV_ONLY.match(match["password"]), "the database password in the URL must be interpolated"
    postgres_env = env_dict(services["postgres"]["environment"])
    assert match["user"] == postgres_env["POSTGRES_USER"] and match["db"] == postgres_env["POSTGRES_DB"]
    assert match["password"].split(":")[0].strip("${}") in postgres_env["POSTGRES_PASSWORD"]
    assert env.get("PREFECT_SERVER_API_HOST") == "0.0.0.0"
    assert "4200:4200" in [str(p) for p in server["ports"]]
    assert server["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "pg_isready" in " ".join(as_list(services["postgres"]["healthcheck"]["test"]))
    assert any(str(v).endswith(":/var/lib/postgresql/data") for v in services["postgres"]["volumes"])


def test_bucket_is_created_once_minio_is_healthy(services: dict[str, dict[str, Any]]) -> None:
    init = [(n, s) for n, s in services.items() if "mc mb" in " ".join(as_list(s.get("command")) + as_list(s.get("entrypoint")))]
    assert len(init) == 1, "no one-shot service creating the results bucket"
    name, service = init[0]
    assert image_is_pinned(service["image"]) and "minio/mc" in service["image"]
    store = next(n for n, s in services.items() if "minio/minio" in str(s.get("image")))
    assert service["depends_on"][store]["condition"] == "service_healthy"
    assert service.get("restart") == "no"


def test_health_conditions_point_at_healthchecks(services: dict[str, dict[str, Any]]) -> None:
    conditions = 0
    for name, service in services.items():
        depends = service.get("depends_on") or {}
        for target, spec in (depends.items() if isinstance(depends, dict) else []):
            assert target in services, f"{name} depends on unknown {target}"
            if spec.get("condition") == "service_healthy":
                conditions += 1
                assert "healthcheck" in services[target], f"{name} waits for {target} to be healthy; it has no healthcheck"
            if spec.get("condition") == "service_completed_successfully":
                assert services[target].get("restart") == "no", target
    assert conditions >= 4


def strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from strings(key)
            yield from strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from strings(value)


def test_env_example_covers_required_variables(compose: dict[str, Any]) -> None:
    required = {m for text in strings(compose) for m in re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*):?\?", text)}
    assert {"POSTGRES_PASSWORD", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"} <= required
    example = dict(
        line.split("=", 1) for line in (INFRA / ".env.example").read_text().splitlines() if line and not line.startswith("#")
    )
    assert required <= set(example), sorted(required - set(example))
    assert ".env" in (INFRA / ".gitignore").read_text().split()


# ---------------------------------------------------------------------------------------------- terraform
def unquote(value: Any) -> Any:
    """python-hcl2 keeps the quotes of string literals and block labels (v8); drop them and its metadata keys."""
    if isinstance(value, str):
        return value[1:-1] if len(value) >= 2 and value[0] == value[-1] == '"' else value
    if isinstance(value, list):
        return [unquote(v) for v in value]
    if isinstance(value, dict):
        return {unquote(k): unquote(v) for k, v in value.items() if not (k.startswith("__") and k.endswith("__"))}
    return value


def tf_files() -> list[Path]:
    return sorted(TERRAFORM.rglob("*.tf"))


@pytest.fixture(scope="module")
def tf() -> dict[str, Any]:
    """All .tf files merged: block type -> list of blocks."""
    merged: dict[str, list[Any]] = {}
    for path in tf_files():
        with path.open() as f:
            for key, blocks in unquote(hcl2.load(f)).items():
                merged.setdefault(key, []).extend(blocks)
    return merged


def labelled(tf: dict[str, Any], kind: str, type_: str | None = None) -> dict[str, dict[str, Any]]:
    """resource/data blocks of one type as {label: body}, or variables/outputs as {name: body}."""
    out: dict[str, dict[str, Any]] = {}
    for block in tf.get(kind, []):
        for first, body in block.items():
            if type_ is None:
                out[first] = body
            elif first == type_:
                out.update(body)
    return out


def resolve(tf: dict[str, Any], value: Any) -> Any:
    """`${local.x}` and `${var.x}` (its default) to their values; anything else unchanged."""
    match = re.fullmatch(r"\$\{(local|var)\.(\w+)\}", value) if isinstance(value, str) else None
    if not match:
        return value
    if match[1] == "local":
        locals_ = {k: v for block in tf.get("locals", []) for k, v in block.items()}
        return resolve(tf, locals_[match[2]])
    return resolve(tf, labelled(tf, "variable")[match[2]].get("default"))


def test_terraform_files_parse() -> None:
    names = {p.name for p in tf_files()}
    assert {"versions.tf", "main.tf", "variables.tf"} <= names, names
    for path in tf_files():
        with path.open() as f:
            assert isinstance(hcl2.load(f), dict), path


def test_terraform_provider_is_pinned(tf: dict[str, Any]) -> None:
    providers = [p for block in tf["terraform"] for req in block.get("required_providers", []) for p in [req.get("prefect")] if p]
    assert len(providers) == 1
    assert providers[0]["source"] == "prefecthq/prefect"
    assert re.fullmatch(r"(~>|>=|=)\s*\d+(\.\d+)*(\s*,\s*<\s*\d+(\.\d+)*)?", providers[0]["version"]), providers[0]["version"]
    provider = labelled(tf, "provider")["prefect"]
    api_url_var = re.fullmatch(r"\$\{var\.(\w+)\}", provider["endpoint"])[1]  # type: ignore[index]
    assert resolve(tf, provider["endpoint"]).endswith("/api"), api_url_var
    api_key_var = re.fullmatch(r"\$\{var\.(\w+)\}", provider["api_key"])[1]  # type: ignore[index]
    assert labelled(tf, "variable")[api_key_var].get("sensitive") is True


def test_terraform_work_pool_and_flow(tf: dict[str, Any]) -> None:
    pools = labelled(tf, "resource", "prefect_work_pool")
    assert [(p["name"], p["type"]) for p in pools.values()] == [(POOL, "process")]
    flows = labelled(tf, "resource", "prefect_flow")
    assert [f["name"] for f in flows.values()] == ["influence-run", "influence-question"]


def test_terraform_deployments(tf: dict[str, Any]) -> None:
    deployments = {d["name"]: (label, d) for label, d in labelled(tf, "resource", "prefect_deployment").items()}
    assert set(deployments) == {"nightly", "on-demand", "question"}
    (pool_label,) = labelled(tf, "resource", "prefect_work_pool")
    flow_labels = {f["name"]: label for label, f in labelled(tf, "resource", "prefect_flow").items()}
    expected = {"influence-run": (ENTRYPOINT, "flow_parameter_schema.json"), "influence-question": ("flows/question.py:influence_question", "question_parameter_schema.json")}
    for name, (_, d) in deployments.items():
        flow = "influence-question" if name == "question" else "influence-run"
        assert resolve(tf, d["entrypoint"]) == expected[flow][0], name
        assert d["enforce_parameter_schema"] is True, name
        assert d["work_pool_name"] in (POOL, f"${{prefect_work_pool.{pool_label}.name}}"), name
        assert d["flow_id"] == f"${{prefect_flow.{flow_labels[flow]}.id}}", name
        assert expected[flow][1] in str(resolve(tf, d["parameter_openapi_schema"])), name
        pull = resolve(tf, d["pull_steps"])
        assert pull[0]["type"] == "set_working_directory", name
        assert (ROOT / "infra/docker/Dockerfile").read_text().count(f"WORKDIR {resolve(tf, pull[0]['directory'])}") == 1
    params = resolve(tf, "${local.stack_params}")
    assert params["compute"]["cluster"] == "address"
    assert resolve(tf, params["compute"]["address"]) == SCHEDULER_ADDRESS
    assert resolve(tf, params["storage"]["endpoint_url"]) == "http://minio:9000"


def test_terraform_nightly_schedule_is_cron(tf: dict[str, Any]) -> None:
    deployments = {d["name"]: label for label, d in labelled(tf, "resource", "prefect_deployment").items()}
    schedules = list(labelled(tf, "resource", "prefect_deployment_schedule").values())
    targets = [s["deployment_id"] for s in schedules]
    assert targets == [f"${{prefect_deployment.{deployments['nightly']}.id}}"], targets
    cron = resolve(tf, schedules[0]["cron"])
    assert isinstance(cron, str) and len(cron.split()) == 5, cron
    assert schedules[0].get("active") is True
    assert not any(k in schedules[0] for k in ("interval", "rrule"))


def test_terraform_parameter_schema_matches_the_flow() -> None:
    """The stored schema equals what `prefect deploy` derives from influence_run (one parameter per section);
    regenerate with infra/terraform/update_parameter_schema.py."""
    from prefect.utilities.callables import parameter_schema

    from flows.influence_run import influence_run
    from flows.parameters import RunParameters

    from flows.question import influence_question

    stored = json.loads((TERRAFORM / "flow_parameter_schema.json").read_text())
    assert set(stored["properties"]) == set(RunParameters.model_fields)
    assert stored == json.loads(json.dumps(parameter_schema(influence_run).model_dump_for_openapi())), "flow_parameter_schema.json is stale: run infra/terraform/update_parameter_schema.py"
    question = json.loads((TERRAFORM / "question_parameter_schema.json").read_text())
    assert set(question["properties"]) == {"run_url", "queries", "top_k", "output_url", "storage", "search", "rerank"}
    assert question == json.loads(json.dumps(parameter_schema(influence_question).model_dump_for_openapi())), "question_parameter_schema.json is stale: run infra/terraform/update_parameter_schema.py"


def test_terraform_and_prefect_yaml_describe_the_same_deployments(tf: dict[str, Any]) -> None:
    """Tags and concurrency limits agree between the two ways of deploying; parameters are sections, not `params`."""
    from flows.parameters import RunParameters

    from_yaml = {d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}
    from_tf = {d["name"]: d for d in labelled(tf, "resource", "prefect_deployment").values()}
    assert set(from_yaml) == set(from_tf)
    for name, d in from_tf.items():
        assert d["tags"] == from_yaml[name]["tags"], name
        assert d["concurrency_limit"] == from_yaml[name]["concurrency_limit"] >= 1, name
        if name == "question":  # the question flow's own parameters: the storage section the stack gives
            assert "local.stack_params.storage" in d["parameters"] and "parameters" not in from_yaml[name], name
            continue
        assert set(from_yaml[name]["parameters"]) <= set(RunParameters.model_fields), name
        assert "jsonencode(merge(local.stack_params" in d["parameters"] and "params =" not in d["parameters"], name
    assert [p["concurrency_limit"] for p in labelled(tf, "resource", "prefect_work_pool").values()] == [2]


def test_terraform_failure_notification_matches_the_service_module(tf: dict[str, Any]) -> None:
    """Terraform's automation on failed runs is flows/service.py's: same names, trigger, subject and body, posting
    through a custom-webhook block whose URL is a sensitive variable kept out of the state (data_wo)."""
    from flows import service

    (block,) = labelled(tf, "resource", "prefect_block").values()
    (automation,) = labelled(tf, "resource", "prefect_automation").values()
    assert block["name"] == service.BLOCK and block["type_slug"] == "custom-webhook" and "data_wo" in block and "data" not in block
    assert "var.failure_webhook_url" in block["data_wo"] and labelled(tf, "variable")["failure_webhook_url"]["sensitive"] is True
    assert automation["name"] == service.AUTOMATION
    event = automation["trigger"]["event"]
    assert event["expect"] == ["prefect.flow-run.Failed"] and event["posture"] == "Reactive" and event["threshold"] == 1
    assert '"prefect.resource.name" = "influence-run"' in event["match_related"]
    (action,) = automation["actions"]
    assert action["type"] == "send-notification" and action["block_document_id"] == "${prefect_block.failure_webhook[0].id}"
    assert (action["subject"], action["body"]) == (service.SUBJECT, service.BODY)


def test_terraform_fmt() -> None:
    terraform = shutil.which("terraform")
    if terraform is None:
        pytest.skip("terraform is not installed")
    result = subprocess.run([terraform, "fmt", "-check", "-recursive", str(TERRAFORM)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"not formatted: {result.stdout}{result.stderr}"


# ---------------------------------------------------------------------------------------------- helm
@pytest.fixture(scope="module")
def worker_values() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((HELM / "prefect-worker-values.yaml").read_text()) if d]
    assert len(docs) == 1
    return docs[0]


@pytest.fixture(scope="module")
def dask_docs() -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((HELM / "dask-cluster.yaml").read_text()) if d]
    assert docs and all(d["apiVersion"] == "kubernetes.dask.org/v1" for d in docs)
    return docs


def test_helm_worker_values(worker_values: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    worker = worker_values["worker"]
    image = f"{worker['image']['repository']}:{worker['image']['prefectTag']}"
    assert image_is_pinned(image), image
    assert image == services["prefect-worker"]["image"], "the chart should run the same project image as compose"
    assert worker["config"]["workPool"] == POOL
    assert worker["config"]["type"] == "process"
    assert worker["apiConfig"] == "selfHostedServer"
    assert worker["selfHostedServerApiConfig"]["apiUrl"].endswith(":4200/api")
    # the chart's default command (/opt/prefect/entrypoint.sh) exists only in Prefect's images
    assert worker["command"] and worker["command"][0] == "/usr/bin/tini"
    assert "tini" in DOCKERFILE.read_text()
    env = {e["name"]: e for e in worker["extraEnvVars"]}
    for key in ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]:
        assert "value" not in env[key] and env[key]["valueFrom"]["secretKeyRef"]["key"] == key, key
    assert worker["resources"]["requests"] and worker["resources"]["limits"]


def worker_containers(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        if doc["kind"] in ("DaskCluster", "DaskWorkerGroup"):
            groups[doc["metadata"]["name"]] = doc["spec"]["worker"]["spec"]["containers"]
    return groups


def test_helm_images_are_pinned(dask_docs: list[dict[str, Any]]) -> None:
    images = [m["image"] for m in walk(dask_docs) if "image" in m]
    assert len(images) >= 3
    for image in images:
        assert image_is_pinned(image), image


def test_dask_cluster_scheduler_and_workers(dask_docs: list[dict[str, Any]]) -> None:
    (cluster,) = [d for d in dask_docs if d["kind"] == "DaskCluster"]
    # the operator names the scheduler Service <cluster>-scheduler: the address flows use
    assert f"tcp://{cluster['metadata']['name']}-scheduler:8786" == SCHEDULER_ADDRESS
    ports = [p["port"] for p in cluster["spec"]["scheduler"]["service"]["ports"]]
    assert 8786 in ports
    groups = worker_containers(dask_docs)
    assert len(groups) >= 2
    for group, containers in groups.items():
        for container in containers:
            args = as_list(container["args"])
            assert args[:1] == ["dask"] and "worker" in args, group
            assert flag_value(args, "--nthreads") == "1", f"{group}: workers must be single-threaded"
            env = {e["name"]: e for e in container.get("env", [])}
            assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"], group


def test_dask_gpu_worker_group(dask_docs: list[dict[str, Any]]) -> None:
    (cluster,) = [d for d in dask_docs if d["kind"] == "DaskCluster"]
    gpu_groups = [d for d in dask_docs if d["kind"] == "DaskWorkerGroup" and d["spec"]["cluster"] == cluster["metadata"]["name"]]
    gpu_containers = [c for g in gpu_groups for c in g["spec"]["worker"]["spec"]["containers"] if "cuda" in as_list(c["args"])]
    assert gpu_containers, "no dask-cuda worker group attached to the cluster"
    for container in gpu_containers:
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        assert container["image"].endswith("-gpu"), container["image"]


# ---------------------------------------------------------------------------------------------- public schemas
# tests/infra/schemas/ holds the published schemas (see its README): the dask-kubernetes operator's CRDs and the
# prefect-worker chart's values.schema.json, so that the manifests are checked as the API server / helm would.
SCHEMAS = Path(__file__).with_name("schemas")


def crd_schemas() -> dict[str, dict[str, Any]]:
    """kind -> the openAPIV3Schema of its served version, from the stored CRDs."""
    schemas = {}
    for path in SCHEMAS.glob("*.crd.yaml"):
        crd = yaml.safe_load(path.read_text())
        (version,) = [v for v in crd["spec"]["versions"] if v["served"]]
        schemas[crd["spec"]["names"]["kind"]] = version["schema"]["openAPIV3Schema"]
    return schemas


def schema_errors(schema: dict[str, Any], doc: Any) -> list[str]:
    import jsonschema

    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]


def test_dask_manifests_match_the_operator_crds(dask_docs: list[dict[str, Any]]) -> None:
    schemas = crd_schemas()
    assert {"DaskCluster", "DaskWorkerGroup"} <= set(schemas)
    for doc in dask_docs:
        assert not schema_errors(schemas[doc["kind"]], doc), (doc["kind"], schema_errors(schemas[doc["kind"]], doc))
    # the check bites: a GPU count as a YAML integer is what the CRD refuses (resource quantities are strings)
    group = next(d for d in dask_docs if d["kind"] == "DaskWorkerGroup")
    broken = json.loads(json.dumps(group))
    broken["spec"]["worker"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 1
    assert any("nvidia.com/gpu: 1 is not of type 'string'" in e for e in schema_errors(schemas["DaskWorkerGroup"], broken))


def test_helm_worker_values_match_the_chart_schema(worker_values: dict[str, Any]) -> None:
    schema = json.loads((SCHEMAS / "prefect-worker.values.schema.json").read_text())
    assert not schema_errors(schema, worker_values), schema_errors(schema, worker_values)
    assert schema_errors(schema, {**worker_values, "worker": {**worker_values["worker"], "replicaCount": "two"}})


def test_image_user_owns_the_source_directory() -> None:
    """The image runs as UID 1001 and writes beside the source (runs/, caches): the directory and the copied files
    are that user's."""
    _, stages = dockerfile_stages()
    base = " ".join(stages["base"])
    workdir = re.search(r"WORKDIR (\S+)", base)[1]  # type: ignore[index]
    assert re.search(rf"install -d -o 1001 -g 1001 {re.escape(workdir)}(\s|$)", base), "WORKDIR is created by root"
    for name in ("cpu", "gpu"):
        copies = [line for line in stages[name] if line.startswith("COPY")]
        assert copies and all(line.startswith("COPY --chown=1001:1001 ") for line in copies), name
        assert stages[name].index("USER 1001") > max(stages[name].index(c) for c in copies), name


def test_compose_needs_v2_and_is_deployed_with_terraform() -> None:
    """The top-level `name:` is a Compose v2 key, and prefect.yaml is for `make serve` (host paths, local Dask):
    the compose stack's deployments come from Terraform."""
    assert "name" in yaml.safe_load(COMPOSE_FILE.read_text())
    header = COMPOSE_FILE.read_text().split("\nname:")[0]
    readme = (INFRA / "README.md").read_text()
    assert "Compose v2" in header and "Compose v2" in readme
    assert "prefect deploy --all" not in readme.split("## Single machine (compose)")[1].split("\n## ")[0]


def test_every_copied_path_exists_and_is_not_ignored() -> None:
    """Each `COPY` source of the Dockerfile is in the repository and not excluded from the build context by its
    .dockerignore (an `!` exception re-includes it), so the build cannot fail on a missing file."""
    lines = (INFRA / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    ignored = [p for p in patterns if not p.startswith("!") and "*" not in p]
    kept = {p[1:] for p in patterns if p.startswith("!")}
    sources = [part for line in DOCKERFILE.read_text().splitlines() if line.startswith("COPY ") and "--from" not in line
               for part in line.split()[1:-1] if not part.startswith("--")]
    assert sources, "no COPY instruction found"
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
        excluded = any(source == p or source.startswith(p + "/") for p in ignored)
        assert not excluded or source in kept, f"COPY {source}: excluded by the .dockerignore; add !{source}"


def test_serve_names_every_deployment_and_the_readme_s_service_commands_run_as_written() -> None:
    """Issue 52, item 18: serve.sh's closing "UI:" line names every deployment of prefect.yaml (the question's was
    missing), and every `prefect` command of the README's shell blocks is the virtual environment's (plain `prefect`
    is not on PATH after `make install`), after PREFECT_API_URL is exported (without it: "Deployment … not found"),
    and names a deployment that prefect.yaml deploys."""
    from importlib import import_module

    deployments = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    names = set()
    for deployment in deployments:
        path, attribute = deployment["entrypoint"].split(":")
        path = path.removesuffix(".py").replace("/", ".")
        names.add(f"{getattr(import_module(path), attribute).name}/{deployment['name']}")
    ui = next(line for line in (INFRA / "serve.sh").read_text().splitlines() if line.startswith('echo "UI: '))
    assert names == set(re.findall(r"[\w-]+/[\w-]+", ui.split("deployments:")[1])), ui
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    commands = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    calls = [i for i, line in enumerate(commands) if re.search(r"(^|\s|/)prefect\s", line)]
    assert calls, "the README shows no prefect command"
    for i in calls:
        assert commands[i].startswith(".venv/bin/prefect "), commands[i]
        assert any(line.startswith("export PREFECT_API_URL=http://127.0.0.1:4200/api") for line in commands[:i]), commands[i]
        for named in re.findall(r"deployment run (\S+)", commands[i]):
            assert named in names, named
