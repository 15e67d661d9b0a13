"""Regenerate flow_parameter_schema.json and question_parameter_schema.json, the parameter schemas Terraform sends
with the deployments (influence-run's and influence-question's).

Prefect validates run parameters against this schema (enforce_parameter_schema = true), and `prefect deploy`
would compute it from the flow; Terraform cannot, so it is kept here and checked for drift by
tests/infra/test_infra_static.py. Run after changing RunParameters:

    .venv/bin/python infra/terraform/update_parameter_schema.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGETS = {"flows.influence_run:influence_run": "flow_parameter_schema.json", "flows.question:influence_question": "question_parameter_schema.json"}


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from importlib import import_module

    from prefect.utilities.callables import parameter_schema

    for path, name in TARGETS.items():
        module, attribute = path.split(":")
        schema = parameter_schema(getattr(import_module(module), attribute)).model_dump_for_openapi()
        target = Path(__file__).with_name(name)
        target.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        print(f"wrote {target.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
