"""Regenerate flow_parameter_schema.json, the parameter schema Terraform sends with the deployments.

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
TARGET = Path(__file__).with_name("flow_parameter_schema.json")


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from prefect.utilities.callables import parameter_schema

    from flows.influence_run import influence_run

    schema = parameter_schema(influence_run).model_dump_for_openapi()
    TARGET.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
    print(f"wrote {TARGET.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
