/*
 * vllm.h -- the C ABI of vengine (libvengine.so).
 *
 * A C11 / C++ header for native hosts that drive vengine's in-process engine.
 * The text-completion subset is kept source- and layout-compatible with the C
 * ABI of vllm.cpp (same function names, argument order, struct field names and
 * order, callback shape), so hosts written against that ABI (e.g. LocalAI's
 * backend) compile and run unchanged. vengine's own additions are appended at
 * the END of structs only.
 *
 * Conventions
 *  - Every fallible call returns a vllm_status. On a non-OK status,
 *    vllm_last_error() (thread-local, never NULL) says what went wrong.
 *  - Ownership: `char*` results are malloc'd by the library and released by the
 *    caller with vllm_string_free / vllm_completion_free. `const char*` results
 *    (finish_reason, vllm_last_error, vllm_version, vllm_request_error) point to
 *    library storage and must not be freed.
 *  - Input strings and arrays are borrowed for the duration of the call only.
 *  - A parameter field set to a feature vengine does not implement is refused
 *    with VLLM_ERR_INVALID_ARGUMENT and a message naming the field; it is never
 *    silently ignored.
 *  - After fork(), calls in the child return VLLM_ERR_RUNTIME (the engine's
 *    threads do not exist there); a child that needs an engine must exec a
 *    program that loads one. exit() in such a child (forked after the first vllm_engine_load; also a
 *    return from main) is safe: it flushes stdio and ends the process at once
 *    with its status. Exit handlers registered before the fork do not run
 *    there -- the host's own and those of the libraries the engine loaded
 *    (libtorch's wait for a Python lock no thread of the child holds); the
 *    handlers the child registers itself do. This needs glibc (on_exit); with
 *    another C library end such a child with _exit() or exec.
 *  - The library does not change signal dispositions. It blocks SIGPIPE in
 *    the calling thread while a call runs (a write to an engine process that
 *    died fails with an error instead of terminating the host).
 *  - The library is never unloaded (dlclose is a no-op for it).
 */
#ifndef VENGINE_VLLM_H_
#define VENGINE_VLLM_H_

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Layout level of the vllm.cpp ABI this header matches (model params up to
 * kv_cache_memory_bytes, sampling params up to logits_processor_user_data,
 * chat and pre-tokenized entry points). Compare with vllm_abi_version(). */
#define VLLM_ABI_VERSION 16

#ifndef VLLM_API
#if defined(_WIN32)
#define VLLM_API __declspec(dllimport)
#else
#define VLLM_API __attribute__((visibility("default")))
#endif
#endif

/* ---- status -------------------------------------------------------------- */
typedef enum vllm_status {
  VLLM_OK = 0,
  VLLM_ERR_INVALID_ARGUMENT = 1, /* NULL / out-of-range / unsupported argument */
  VLLM_ERR_MODEL_LOAD = 2,       /* model directory, config, tokenizer or weights */
  VLLM_ERR_RUNTIME = 3,          /* engine failure, engine dead, forked child, ... */
  VLLM_ERR_UNKNOWN = 4           /* anything else */
} vllm_status;

/* ---- opaque handles ------------------------------------------------------ */
typedef struct vllm_engine vllm_engine;   /* one loaded model + its engine threads */
typedef struct vllm_request vllm_request; /* one request made by vllm_request_submit */

/* ---- engine parameters --------------------------------------------------- *
 * Fill with vllm_model_params_default() (or vllm_model_params_init()) and
 * override. Strings are copied during vllm_engine_load. */
typedef struct vllm_model_params {
  const char* model_path;            /* Hugging Face model directory. Required. */
  const char* tokenizer_config_path; /* NULL: the model's tokenizer; else a tokenizer
                                        directory or its tokenizer_config.json */
  int32_t block_size;                /* KV block size in tokens; <= 0: engine default (16) */
  int32_t num_blocks;                /* KV blocks; <= 0: sized from kv_cache_memory_bytes /
                                        gpu_memory_utilization / the CPU default */
  int32_t max_model_len;             /* <= 0: from the model config */
  int32_t max_num_seqs;              /* <= 0: engine default */
  const char* tool_parser;           /* not supported: must be NULL or "" */
  const char* reasoning_parser;      /* "qwen3" / "deepseek_r1": vllm_chat* JSON carries reasoning_content
                                        (the tokenizer must have <think> </think>); NULL or "": none */
  const char* speculative_config;    /* NULL/"": off; else vLLM's JSON object, e.g. {"method": "ngram", "num_speculative_tokens": 3} */
  int32_t enable_prefix_caching;     /* 0: default (on), 1: on, 2: off */
  int32_t max_num_batched_tokens;    /* <= 0: engine default */
  const char* scheduling_policy;     /* NULL/"": "fcfs"; or "priority" */
  const char* kv_transfer_config;    /* not supported: must be NULL or "" */
  int32_t enable_jump_forward;       /* 0: default (off), 2: off; 1 (on) is refused */
  int32_t device;                    /* 0: auto, 1: cpu, 2: cuda */
  double gpu_memory_utilization;     /* fraction in (0, 1]; 0: engine default */
  int64_t kv_cache_memory_bytes;     /* > 0: KV pool size in bytes; 0: unset */
  /* ---- vengine additions (appended) ---- */
  int32_t tensor_parallel_size;      /* ranks the model is sharded over (one process and,
                                        on CUDA, one GPU each); 0: 1; < 0 is refused */
  const char* quantization;          /* NULL/"": the checkpoint's (config.json
                                        quantization_config); "fp8": quantize an unquantized
                                        checkpoint at load; another method name must match
                                        the checkpoint's (else refused) */
  const char* kv_cache_dtype;        /* NULL/"": "auto" (the model dtype); "fp8" (e4m3 with
                                        the checkpoint's per-layer scales, else 1.0) */
} vllm_model_params;

/* Custom logits processor (vllm.cpp layout). vengine does not run host code in
 * its sampler: a non-NULL processor is refused. */
typedef void (*vllm_logits_processor)(const int32_t* token_ids, int32_t n_token_ids,
                                      float* logits, int32_t vocab_size, void* user_data);

/* ---- sampling parameters ------------------------------------------------- *
 * Fill with vllm_sampling_params_default() (or vllm_sampling_params_init());
 * a zero-filled struct is not valid (repetition_penalty must be > 0). */
typedef struct vllm_sampling_params {
  /* Every float must be finite (NaN / Infinity: VLLM_ERR_INVALID_ARGUMENT). */
  float temperature;        /* >= 0; 0: greedy */
  float top_p;              /* (0, 1] */
  int32_t top_k;            /* 0 or -1: all tokens */
  float min_p;              /* [0, 1] */
  int32_t max_tokens;       /* <= 0: up to the model length */
  uint64_t seed;            /* used when has_seed != 0; any value: read as the int64_t
                               with the same bits (the engine's seed range is int64) */
  int32_t has_seed;
  float presence_penalty;
  float frequency_penalty;
  float repetition_penalty; /* > 0; 1: off */
  int32_t min_tokens;
  int32_t ignore_eos;       /* 0/1 */
  const char* const* stop;  /* n_stop stop strings, may be NULL */
  int32_t n_stop;
  /* structured output (xgrammar; docs/structured_outputs.md): at most one of
   * structured_json (a JSON schema, as text), structured_regex, structured_choice
   * (n_structured_choice UTF-8 strings), structured_grammar (EBNF / GBNF),
   * structured_json_object = 1 (any JSON object). NULL / 0: unconstrained. An invalid
   * or unsupported constraint is VLLM_ERR_INVALID_ARGUMENT with the engine's message. */
  const char* structured_json;
  const char* structured_regex;
  const char* const* structured_choice;
  int32_t n_structured_choice;
  const char* structured_grammar;
  int32_t structured_json_object;
  /* not supported by vengine, must stay NULL */
  vllm_logits_processor logits_processor;
  void* logits_processor_user_data;
  /* ---- vengine additions (appended) ---- */
  int32_t priority;         /* lower runs first under scheduling_policy "priority" */
  /* vLLM's bad_words: n_bad_words UTF-8 words (may be NULL when 0) that are never
   * generated: each word's tokenization with and without a leading space is banned, a
   * word of several tokens only right after its other tokens. At most 128 non-blank
   * words of at most 1024 characters. */
  const char* const* bad_words;
  int32_t n_bad_words;
  /* vLLM's allowed_token_ids: when n_allowed_token_ids > 0, only these ids (each in the
   * model's vocabulary) may be generated. NULL / 0: every token. */
  const int32_t* allowed_token_ids;
  int32_t n_allowed_token_ids;
} vllm_sampling_params;

/* ---- blocking completion result ------------------------------------------ */
typedef struct vllm_completion {
  char* text;                /* malloc'd; free with vllm_completion_free */
  const char* finish_reason; /* "stop" / "length" / "abort" (static storage) */
  int32_t prompt_tokens;
  int32_t completion_tokens;
} vllm_completion;

/* ---- streaming callback --------------------------------------------------- *
 * Called with each new piece of text (borrowed for the call), then exactly once
 * with finished == true and delta_text == "" when the request ends (finished,
 * stopped, cancelled or failed). Never called twice at once for one request,
 * always in order. Return false to stop the request: further text is dropped
 * and the final (finished == true) call still follows. A call that returns an
 * error before the request started (bad argument, ...) makes no callback. */
typedef bool (*vllm_token_callback)(const char* delta_text, bool finished, void* user_data);

/* ---- library ------------------------------------------------------------- */
VLLM_API const char* vllm_last_error(void); /* thread-local; "" when none; never NULL */
VLLM_API const char* vllm_version(void);
VLLM_API int32_t vllm_abi_version(void);

VLLM_API vllm_model_params vllm_model_params_default(void);
VLLM_API vllm_sampling_params vllm_sampling_params_default(void);
/* Pointer-filling variants for FFI layers that cannot take structs by value.
 * NULL is a no-op. */
VLLM_API void vllm_model_params_init(vllm_model_params* params);
VLLM_API void vllm_sampling_params_init(vllm_sampling_params* params);
/* vengine addition: the engine's own defaults (vLLM's
 * LLM.get_default_sampling_params): vllm_sampling_params_default() overridden by
 * the model's generation_config.json (temperature, top_p, top_k, min_p,
 * repetition_penalty; max_new_tokens as max_tokens), which is what requests
 * that set none of these get on every other front end. Fills *out (left
 * untouched on failure). Errors: VLLM_ERR_INVALID_ARGUMENT (out NULL, not an
 * engine handle), VLLM_ERR_RUNTIME (freed engine). */
VLLM_API vllm_status vllm_engine_sampling_params_default(vllm_engine* engine, vllm_sampling_params* out);

/* ---- engine --------------------------------------------------------------- *
 * Starts the embedded Python (once per process), loads the model and starts
 * the engine threads. On failure *out is NULL. */
VLLM_API vllm_status vllm_engine_load(const vllm_model_params* params, vllm_engine** out);
/* Stops and joins the engine threads. Requests still running end with a final
 * callback and VLLM_ERR_RUNTIME; their handles must still be freed. NULL: no-op.
 * Engines not freed are stopped by an atexit handler (bounded wait).
 * The handle stays safe to pass afterwards: every call with it returns
 * VLLM_ERR_RUNTIME ("the engine was freed"), a second vllm_engine_free does
 * nothing, and no later engine gets the same handle (the library keeps a
 * 16-byte record per vllm_engine_load for this). A pointer that never came
 * from vllm_engine_load is refused with VLLM_ERR_INVALID_ARGUMENT. */
VLLM_API void vllm_engine_free(vllm_engine* engine);

/* ---- blocking calls -------------------------------------------------------- */
VLLM_API vllm_status vllm_complete(vllm_engine* engine, const char* prompt,
                                   const vllm_sampling_params* params, vllm_completion* out);
/* Pre-tokenized prompt; the generated ids go to out_tokens (at most
 * max_out_tokens of them, *n_out_tokens is the number written). `out` may be NULL. */
VLLM_API vllm_status vllm_complete_tokens(vllm_engine* engine, const int32_t* prompt_tokens,
                                          int32_t n_prompt_tokens,
                                          const vllm_sampling_params* params,
                                          int32_t* out_tokens, int32_t max_out_tokens,
                                          int32_t* n_out_tokens, vllm_completion* out);
VLLM_API void vllm_completion_free(vllm_completion* completion); /* frees text, zeroes */
VLLM_API void vllm_string_free(char* s);

/* Blocks; every callback runs on the calling thread. A callback returning
 * false cancels the request and the call still returns VLLM_OK. */
VLLM_API vllm_status vllm_complete_stream(vllm_engine* engine, const char* prompt,
                                          const vllm_sampling_params* params,
                                          vllm_token_callback cb, void* user_data);

/* ---- non-blocking requests ------------------------------------------------ *
 * Returns once the request is queued; the callbacks run on the library's
 * delivery pool, a few threads shared by all requests (cb may be NULL). A
 * slow callback delays only its own request: a request waits for any free
 * delivery thread, not behind another request, and the pool adds a thread
 * when all of its threads are inside callbacks while requests wait
 * (VENGINE_DELIVERY_THREADS, default 4; VENGINE_DELIVERY_THREADS_MAX, 64).
 * The library's threads, these included, run with every signal blocked, so
 * the host's signals keep going to the host's own threads.
 *  - cancel: idempotent, never blocks, may be called from any thread including
 *    the request's own callback.
 *  - wait: blocks until the final callback has returned; returns the request's
 *    status (its message via vllm_last_error()). Called from the request's own
 *    callback it returns VLLM_ERR_INVALID_ARGUMENT instead of deadlocking.
 *  - done / error: never block. error is "" while running and on success.
 *  - free: cancels if needed, waits for the final callback, releases the
 *    handle. Called from the request's own callback it does nothing and sets
 *    vllm_last_error(). No callback runs after wait or free returns.
 * The engine handle may be freed before its requests; their handles stay valid.
 * Request handles are not checked like engine handles: using one after
 * vllm_request_free is undefined, as with free(). */
VLLM_API vllm_status vllm_request_submit(vllm_engine* engine, const char* prompt,
                                         const vllm_sampling_params* params,
                                         vllm_token_callback cb, void* user_data,
                                         vllm_request** out);
VLLM_API vllm_status vllm_request_cancel(vllm_request* request);
VLLM_API vllm_status vllm_request_wait(vllm_request* request);
VLLM_API bool vllm_request_done(const vllm_request* request);
VLLM_API const char* vllm_request_error(const vllm_request* request);
VLLM_API void vllm_request_free(vllm_request* request);

/* ---- OpenAI chat ---------------------------------------------------------- *
 * request_json: one /v1/chat/completions request (messages, max_tokens /
 * max_completion_tokens, temperature, top_p, top_k, min_p, seed, stop,
 * penalties, ignore_eos, min_tokens, priority, chat_template_kwargs,
 * thinking_token_budget (with vllm_model_params.reasoning_parser), ...;
 * response_format, structured_outputs and guided_* as over HTTP; `model` and
 * `stream` are ignored; tools, logprobs, return_token_ids and n > 1 are refused). The model's chat
 * template is applied.
 * vllm_chat: *out_response_json is a malloc'd chat.completion object (free with
 * vllm_string_free). vllm_chat_stream: one chat.completion.chunk JSON object per
 * callback, then the final callback (finished == true, ""). */
VLLM_API vllm_status vllm_chat(vllm_engine* engine, const char* request_json,
                               char** out_response_json);
VLLM_API vllm_status vllm_chat_stream(vllm_engine* engine, const char* request_json,
                                      vllm_token_callback cb, void* user_data);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* VENGINE_VLLM_H_ */
