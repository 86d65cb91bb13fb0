"""A failure record's one-line summary (``report.failures.summarize``): the error's type and the first line of its
message, whatever follows it. Issue 51 met ``failed too: rank 0 ..., after a peer failed ( to Tensor)``: the last
line of a multi-line torch error (a comm hook's failed future, wrapped by torch) stood for the whole error."""

import torch.distributed as dist

from launcher.report.failures import summarize

# what a healing sim job's rank 0 raised when rank 1 failed (its comm hook's future failed; torch wrapped it)
WRAPPED = (
    "Unable to cast Got the following error when running the callback: RuntimeError: [/__w/pytorch/pytorch/"
    "third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:13017. This is typically "
    "caused by a remote worker crashing.\n\nAt:\n  /x/launcher/comm/collectives.py(50): _checked\n"
    "  /x/launcher/comm/collectives.py(59): <lambda>\n to Tensor"
)


def test_the_error_a_failed_callback_raised_not_torchs_wrapper_nor_its_last_line():
    assert summarize(RuntimeError(WRAPPED)) == (
        "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
        "peer [127.0.0.1]:13017. This is typically caused by a remote worker crashing."
    )


def test_the_type_and_the_first_line_of_any_message():
    assert summarize(ValueError("boom")) == "ValueError: boom"
    assert summarize(RuntimeError("first line\nsecond line\n third")) == "RuntimeError: first line"
    assert summarize(KeyError("x")) == "KeyError: 'x'"
    assert summarize(RuntimeError()) == "RuntimeError"
    backend = dist.DistBackendError("NCCL error\nmore")  # a qualified name: torch.distributed.DistBackendError
    assert summarize(backend) == "torch.distributed.DistBackendError: NCCL error"


def test_a_syntax_error_is_named_by_its_own_line_not_the_source_it_quotes():
    try:
        compile("x = (1,\n", "job.py", "exec")
    except SyntaxError as exc:
        said = summarize(exc)
    assert said.startswith("SyntaxError: ") and "(1," not in said, said
