"""Exposition samples in the exact shapes real engines emit (reference/engine.md §1-2)."""

from __future__ import annotations

# vLLM v0.33 V1 engine, two data-parallel engines behind one API server, prometheus_client output.
VLLM_DP2 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen3"} 3.0
vllm:num_requests_running{engine="1",model_name="qwen3"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen3"} 1.0
vllm:num_requests_waiting{engine="1",model_name="qwen3"} 4.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="qwen3",reason="capacity"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="qwen3"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="qwen3"} 0.25
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="qwen3"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="qwen3"} 500.0
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="qwen3"} 1.7959e+09
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="qwen3"} 600.0
vllm:prefix_cache_hits_total{engine="1",model_name="qwen3"} 100.0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="qwen3"} 1200.0
vllm:prompt_tokens_total{engine="1",model_name="qwen3"} 800.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="qwen3"} 300.0
vllm:generation_tokens_total{engine="1",model_name="qwen3"} 200.0
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="qwen3"} 7.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="qwen3"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="qwen3"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.005",model_name="qwen3"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="qwen3"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="qwen3"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="qwen3"} 0.2
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="qwen3"} 6.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="qwen3"} 6.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="qwen3"} 0.8
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="qwen3"} 100.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="qwen3"} 100.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="qwen3"} 2.0
vllm:inter_token_latency_seconds_count{engine="1",model_name="qwen3"} 0.0
vllm:inter_token_latency_seconds_sum{engine="1",model_name="qwen3"} 0.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7959e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql-lora,chat-lora",waiting_lora_adapters="sql-lora"} 1.7959001e+09
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="27000",prefix_caching_hash_algo="sha256"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="1",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="27000",prefix_caching_hash_algo="sha256"} 1.0
"""

# An older vLLM (pre-0.10): gpu_cache_usage_perc, time_per_output_token_seconds, no engine label.
VLLM_OLD = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 2.0
vllm:num_requests_waiting{model_name="m"} 0.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.75
vllm:time_per_output_token_seconds_sum{model_name="m"} 1.5
vllm:time_per_output_token_seconds_count{model_name="m"} 30.0
"""

# Two models served by one server (different served-model-name series).
VLLM_TWO_MODELS = """\
vllm:num_requests_running{engine="0",model_name="a"} 1.0
vllm:num_requests_running{engine="0",model_name="b"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.1
vllm:kv_cache_usage_perc{engine="0",model_name="b"} 0.9
"""

# SGLang 0.5.x with --enable-metrics (scheduler + tokenizer metrics).
SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="qwen3",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 5.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="qwen3",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 2.0
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="qwen3",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.42
# TYPE sglang:page_size gauge
sglang:page_size{engine_type="unified",model_name="qwen3",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 1.0
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{cache_source="device",engine_type="unified",model_name="qwen3"} 300.0
sglang:cached_tokens_total{cache_source="host",engine_type="unified",model_name="qwen3"} 50.0
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{engine_type="unified",is_streaming="true",model_name="qwen3"} 600.0
sglang:prompt_tokens_total{engine_type="unified",is_streaming="false",model_name="qwen3"} 400.0
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{engine_type="unified",is_streaming="true",model_name="qwen3"} 90.0
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{engine_type="unified",is_streaming="true",le="+Inf",model_name="qwen3"} 10.0
sglang:time_to_first_token_seconds_sum{engine_type="unified",is_streaming="true",model_name="qwen3"} 1.0
sglang:time_to_first_token_seconds_count{engine_type="unified",is_streaming="true",model_name="qwen3"} 10.0
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{engine_type="unified",model_name="qwen3",tp_rank="0"} 1234.5
"""
