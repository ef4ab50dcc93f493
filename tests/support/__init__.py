"""Helpers shared by the tests: the implementations under test (``impls``), random cases for every op
(``cases``), GPU stress cases (``gpu_cases``), compiled-HLO readers (``hlo``) and the x64 digest script
(``x64_scenario``, run as a subprocess)."""
