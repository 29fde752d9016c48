"""`python -m tools.measure.evals.lm_eval_main run ...`: lm-eval's own command line, unchanged, except that its
task index holds only the `--include_path` folder when every task asked for is defined there.

lm-eval's TaskManager indexes its ~14,700 built-in task YAMLs on every run unless it is made with
`include_defaults=False`, which lm-eval's command line cannot pass: about 20 s of CPU before the first request
(evidence/suite-speed.md §14), for tasks the run never uses. A run that names any task outside the folder gets
lm-eval's full index, as `lm_eval run` would. Runs in the eval's child process, never imported by a front end.
"""

from __future__ import annotations

import functools
import sys

from tools.measure.evidence import argv_option


def included_only(argv: list[str]) -> bool:
    """Whether every task (or group, or tag) `--tasks` names is defined in the `--include_path` folder(s)."""
    tasks, include = argv_option(argv, "--tasks"), argv_option(argv, "--include_path")
    if not tasks or not include:
        return False
    from lm_eval.tasks import TaskManager

    names = {t.strip() for t in tasks.split(",") if t.strip()}
    return bool(names) and names <= set(TaskManager(include_path=include, include_defaults=False).all_tasks)


def without_builtin_tasks() -> None:
    """Every TaskManager lm-eval makes from here on indexes only the include path (the keyword's default)."""
    from lm_eval.tasks import TaskManager

    TaskManager.__init__ = functools.partialmethod(TaskManager.__init__, include_defaults=False)


def main() -> None:
    if included_only(sys.argv[1:]):
        without_builtin_tasks()
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
