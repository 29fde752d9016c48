"""What the test modules share, one module per topic; no test module imports another test module
(tests/test_tests_layout.py holds it). conftest.py files build the pytest fixtures on these.

fixtures     the project root, free ports, in-process repack runs, signals, stand-in run folders and hardware
serving      clients of a served build, a two-core CPU, the bench of stand-in builds (tests/serving/)
kill_matrix  the signals of the kill matrices, running a command until a phase and signalling it there
mounts       small tmpfs mounts and write errors for the hostile-output tests
capacity     capacity run folders for the capacity comparisons
reaper       ends what a test run started, however the run ends (a pytest plugin, loaded by tests/conftest.py)
start_log    GEMMA4_T4_START_LOG: one JSON line per vLLM server start
stand_ins/   the stand-ins for what the tests do not run for real: vLLM servers, the hub, the switch process,
             vLLM's bench, NVML, and the small HTTP servers the measurements are run against
"""
