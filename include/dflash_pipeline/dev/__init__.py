"""Development tooling: the local stack (stack/), the simulated fleet (sim/), the fault lab, the S3 server.

Used by the demo, the tests, the benches and scripts. It may import anything in the package;
no module outside dev/ imports it (tests/integrity/test_layering.py proves it).
"""
