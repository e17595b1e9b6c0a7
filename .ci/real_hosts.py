"""``.ci/run``'s check that the real-host tests really ran: every test on the list the default suite skipped
(``.ci/skipped.py``) must have *passed* in at least one host environment, by the junit-xml each host phase writes
(``pytest --junitxml``). A listed test that skipped again everywhere, failed, or was never collected (renamed,
deselected, a module the environments skip whole) is named, with what it did in each environment, and the exit
status is 1. A listed module (skipped whole by the default suite) needs at least one test run and every test of it
that ran to have passed somewhere.

    python .ci/real_hosts.py SKIPPED_LIST JUNIT_XML...     # one junit file per host environment, named by its stem less "junit-"
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

Key = tuple[str, str]  # a junit testcase's (classname, name)
SEVERITY = {"passed": 0, "skipped": 1, "failed": 2}  # a test reported twice (a teardown error) keeps its worst


def junit_key(nodeid: str) -> Key:
    """(classname, name) that pytest's junit-xml gives a node id (``_pytest/junitxml.py`` ``mangle_test_address``)."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def outcomes(junit: Path) -> dict[Key, str]:
    """Each testcase of a junit-xml file -> passed, skipped or failed (a failure or an error)."""
    found: dict[Key, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        children = {child.tag for child in case}
        outcome = "failed" if children & {"failure", "error"} else "skipped" if "skipped" in children else "passed"
        key = (case.get("classname", ""), case.get("name", ""))
        if SEVERITY[outcome] >= SEVERITY.get(found.get(key, "passed"), 0):
            found[key] = outcome
    return found


def _seen(key: Key, module: str, runs: dict[str, dict[Key, str]]) -> str:
    """What a test of ``module`` (dotted) did in each environment, or that the whole module skipped there."""
    said = [
        f"{run[key]} in {env}" if key in run else f"its module skipped whole in {env}"
        for env, run in runs.items()
        if key in run or ("", module) in run  # a module's own skip record: classname "", name the module
    ]
    return "; ".join(said) or "not run anywhere"


def unmet(listed: list[str], runs: dict[str, dict[Key, str]]) -> list[str]:
    """One line per listed test (or module) that passed in no environment of ``runs`` (env name -> outcomes)."""
    lines = []
    for entry in listed:
        module = junit_key(entry.split("::")[0])[1]  # the dotted path its tests' classnames start with
        if "::" in entry:
            key = junit_key(entry)
            if not any(run.get(key) == "passed" for run in runs.values()):
                lines.append(f"{entry}: {_seen(key, module, runs)}")
            continue
        tests = sorted({k for run in runs.values() for k in run if k[0] == module or k[0].startswith(module + ".")})
        failing = [k for k in tests if not any(run.get(k) == "passed" for run in runs.values())]
        if not tests:
            lines.append(f"{entry} (a module): no test of it ran in any environment")
        for key in failing:
            lines.append(f"{entry} (a module), {key[0]}::{key[1]}: {_seen(key, module, runs)}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    listed = [line.strip() for line in Path(argv[0]).read_text(encoding="utf-8").splitlines() if line.strip()]
    missing = [path for path in argv[1:] if listed and not Path(path).is_file()]
    if missing:
        print(f"real-host tests: {len(listed)} listed, but no junit-xml at {', '.join(missing)} (that phase did not run)")
        return 1
    runs = {Path(path).stem.removeprefix("junit-"): outcomes(Path(path)) for path in argv[1:] if Path(path).is_file()}
    lines = unmet(listed, runs)
    if lines:
        print(f"real-host tests that passed in no environment ({len(lines)} of {len(listed)} listed):")
        print("\n".join(f"  {line}" for line in lines))
        return 1
    print(f"real-host tests: all {len(listed)} listed passed in at least one of {', '.join(runs) or 'no environment'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
