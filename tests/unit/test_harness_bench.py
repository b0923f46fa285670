"""What the harness keeps of vLLM's benchmark JSON: the failed requests' errors, not the per-request rest."""

from __future__ import annotations

from harness import vllm


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


def test_the_engines_log_problems_leave_out_vllms_and_uvicorns_routine_lines(tmp_path) -> None:
    log = tmp_path / "vllm.log"
    log.write_bytes(b"(APIServer pid=7) INFO 12-01 04:55:56 [loggers.py:199] Engine 000: Iteration(0): ...\n"
                    b'INFO:     127.0.0.1:42076 - "POST /v1/completions HTTP/1.1" 200 OK\n'
                    b"(APIServer pid=7) WARNING 12-01 04:55:19 [system_utils.py:255] Found ulimit of 20000\n"
                    b"(EngineCore pid=9) ERROR 12-01 04:56:00 [core.py:1] EngineCore failed\n"
                    b"Traceback (most recent call last):\n")
    server = vllm.VllmServer("/nonexistent-model", log_path=log)
    assert server.log_problems() == "<no log>"  # not started
    server.log_path = log  # what start() sets
    assert server.log_problems() == ("(APIServer pid=7) WARNING 12-01 04:55:19 [system_utils.py:255] Found ulimit "
                                     "of 20000\n(EngineCore pid=9) ERROR 12-01 04:56:00 [core.py:1] EngineCore "
                                     "failed\nTraceback (most recent call last):\n")
    assert server.log_problems(n=1) == "Traceback (most recent call last):\n"
