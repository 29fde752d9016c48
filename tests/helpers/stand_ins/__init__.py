"""The stand-ins, one home: each stands for something the tests do not run for real.

vllm_server  a vLLM server as a process (a script: serves, loads, hangs, fails as told; its HTTP side also served
             in a thread), and drivers of the command line and the MCP server with it where vLLM would be
switch       the front door's switch process over stand-in builds
hub          a Hugging Face hub over HTTP in a thread
bench        vLLM's `bench serve`, as a package on a benchmark worker's PYTHONPATH
nvml         pynvml's functions for one or more GPUs
measure      HTTP servers in a thread for the measuring commands (decode, sweep, capacity, compare, fidelity,
             eval), and serve_in_thread, which serves any of them
fidelity     a vLLM server with a bigram model, in a thread, for fidelity record and check
router_worker a vLLM worker behind the router, as a script

A test module defines no HTTP server of its own (tests/test_tests_layout.py holds it): one that needs a test's state
is made by a function here taking it.
"""
