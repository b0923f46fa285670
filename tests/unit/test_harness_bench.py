"""What the harness keeps of vLLM's benchmark JSON: the failed requests' errors, not the per-request rest."""

from __future__ import annotations

from tests.support import vllm


def test_the_summary_keeps_each_distinct_error_with_its_count_and_drops_the_per_request_fields() -> None:
    detailed = {
        "completed": 3,
        "failed": 3,
        "latencies": [1.0, 2.0, 3.0, 0.0, 0.0, 0.0],
        "ttfts": [0.1] * 6,
        "itls": [[0.01]] * 6,
        "generated_texts": ["x"] * 6,
        "input_lens": [128] * 6,
        "output_lens": [4] * 6,
        "start_times": [0.0] * 6,
        "errors": ["", "", "", "Traceback ...\nServerDisconnectedError\n", "ServerDisconnectedError", "Bad Request"],
    }
    summary = vllm.summarised(detailed)
    assert summary == {
        "completed": 3,
        "failed": 3,
        "latencies": [1.0, 2.0, 3.0, 0.0, 0.0, 0.0],
        "errors": {"Traceback ...\nServerDisconnectedError": 1, "ServerDisconnectedError": 1, "Bad Request": 1},
    }
    assert vllm.failures(summary) == ("\n  1 x Traceback ...\nServerDisconnectedError\n  1 x ServerDisconnectedError"
                                      "\n  1 x Bad Request")
    assert vllm.summarised({"completed": 2, "errors": ["", ""]})["errors"] == {}
    assert vllm.failures({"errors": {}}) == " (no error text)"
