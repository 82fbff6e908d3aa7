"""`npuserve doctor`: can this machine serve, and if not, what to fix.

`facts` reads the machine (version files, package metadata, `npu-smi`, /dev, environment),
`host_checks` and `model_checks` turn it into `report.Check`s against the `version_matrix`, and
`command` prints the verdict. Nothing imports torch_npu or loads weights.
"""
