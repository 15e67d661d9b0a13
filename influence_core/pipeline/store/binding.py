"""What answers a question is bound together: a finished run's stages (data, model, curvature, index, scores) are
each complete and intact in the store, each is the very output the run recorded (the same content digest), and
each was made from the others' recorded outputs (a stage's manifest names the inputs' digests it was made from).
A question, `show` and `verify` check this before using any of them; a damaged, swapped or half-repaired stage is
refused in one line that names it and the command that repairs it."""

from __future__ import annotations

from typing import Any

from .integrity import DamagedError
from .refs import DataRef, Ref, StageRef
from .run_store import RunStore
from .stage import StageLocation


def repair_fix(store: RunStore) -> str:
    """How to repair a finished run's damaged stages: run it again with its own recorded parameters; where the stage
    store is a separate one, it may instead have moved."""
    fix = f"run `influence-pipeline repair {store.output_url}`: it runs the pipeline again with the run's recorded parameters, which recomputes what is damaged and keeps the rest"
    if store.storage.cache_url:
        fix += f"; if its stage store (storage.cache_url {store.cache_url}) has moved, give its new place with --cache-url"
    return fix


def stage_problems(store: RunStore, name: str, ref: StageRef, by_key: dict[tuple[str, str], StageRef], deep: bool = False) -> list[str]:
    """What is wrong with stage `name` of a finished run (empty: complete, intact, and bound to the run's other
    stages). `by_key`: the run's refs by (stage, key); `deep` hashes every byte instead of trusting unchanged stamps."""
    if not ref.key:
        return ["was recorded by a version without content records: it cannot be checked"]
    location = StageLocation(store, ref.stage, ref.key)
    found = location.check(type(ref), deep)
    if not isinstance(found, Ref):
        return found
    if found.digest != ref.digest:
        return [f"at {location.url} was recomputed with other content since this run used it"]
    manifest = location.manifest() or {}
    return [f"was made from another {label} than the run's" for label, recorded in manifest.get("inputs", {}).items() if not _same_input(store, recorded, by_key)]


def _same_input(store: RunStore, recorded: dict[str, Any], by_key: dict[tuple[str, str], StageRef]) -> bool:
    """Whether an input a manifest records is the run's own: a stage output by its content digest, the training rows
    by their content fingerprint; an input the run does not hold is not judged here."""
    if "stage" in recorded:
        used = by_key.get((recorded["stage"], recorded.get("key", "")))
        return used is None or used.digest == recorded.get("digest")
    data = next((ref for ref in by_key.values() if isinstance(ref, DataRef)), None)
    if data is None or store.resolve(recorded.get("url", "")) != data.url:
        return True
    return recorded.get("fingerprint") in (data.training.fingerprint, data.fingerprint)


def check_stages(store: RunStore, refs: dict[str, StageRef], names: list[str], deep: bool = False) -> dict[str, list[str]]:
    """`stage_problems` of each named stage of the run (those it has), by name; empty lists when all is well."""
    by_key = {(ref.stage, ref.key): ref for ref in refs.values()}
    return {name: stage_problems(store, name, refs[name], by_key, deep) for name in names if name in refs}


def require_stages(store: RunStore, refs: dict[str, StageRef], names: list[str]) -> None:
    """Refuse, in one line naming the first damaged stage and the repair, unless every named stage checks."""
    for name, wrong in check_stages(store, refs, names).items():
        if wrong:
            more = f" (and {len(wrong) - 1} more problems)" if len(wrong) > 1 else ""
            raise DamagedError(name, f"the run at {store.output_url} cannot be used: its {name} output {wrong[0]}{more}", repair_fix(store))
