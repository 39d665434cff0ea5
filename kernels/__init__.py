"""dsq's compute kernels, installed as `dsq.kernels` (this folder is the repository's kernels/).

Each weight format has a plain torch reference (the oracle and the fallback); the dispatcher in
`dispatch` is what the runtime's quantized modules call, so faster kernels slot in there.
"""
