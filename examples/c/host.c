/*
 * A small C host for libvengine.so: loads a model, submits one request per
 * prompt from its own thread (vllm_request_submit), and streams every request's
 * text to stdout as it arrives, each line tagged with its request number.
 *
 *   make -C examples/c            # builds libvengine.so (python -m capi.build) and ./host
 *   examples/c/host MODEL_DIR "prompt one" "prompt two" ...
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vllm.h"

static pthread_mutex_t out_mu = PTHREAD_MUTEX_INITIALIZER;

typedef struct job {
  vllm_engine* engine;
  const char* prompt;
  int index;
  vllm_status status;
  char error[512];
} job;

/* Runs on a library delivery thread: in order, never twice at once for one request. */
static bool on_text(const char* delta, bool finished, void* user_data) {
  job* j = (job*)user_data;
  pthread_mutex_lock(&out_mu);
  if (finished)
    printf("[%d] <done>\n", j->index);
  else
    printf("[%d] %s\n", j->index, delta);
  fflush(stdout);
  pthread_mutex_unlock(&out_mu);
  return true; /* false would stop this request */
}

static void* run(void* arg) {
  job* j = (job*)arg;
  vllm_sampling_params sp = vllm_sampling_params_default();
  sp.temperature = 0.0f;
  sp.max_tokens = 24;
  vllm_request* req = NULL;
  j->status = vllm_request_submit(j->engine, j->prompt, &sp, on_text, j, &req);
  if (j->status != VLLM_OK) {
    snprintf(j->error, sizeof j->error, "%s", vllm_last_error());
    return NULL;
  }
  j->status = vllm_request_wait(req); /* after this, no callback for req runs */
  if (j->status != VLLM_OK) snprintf(j->error, sizeof j->error, "%s", vllm_request_error(req));
  vllm_request_free(req);
  return NULL;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s MODEL_DIR PROMPT [PROMPT...]\n", argv[0]);
    return 2;
  }
  printf("vengine %s, C ABI %d\n", vllm_version(), vllm_abi_version());
  vllm_model_params mp = vllm_model_params_default();
  mp.model_path = argv[1];
  vllm_engine* engine = NULL;
  vllm_status st = vllm_engine_load(&mp, &engine);
  if (st != VLLM_OK) {
    fprintf(stderr, "load failed (%d): %s\n", st, vllm_last_error());
    return 1;
  }
  int n = argc - 2;
  job* jobs = (job*)calloc((size_t)n, sizeof *jobs);
  pthread_t* threads = (pthread_t*)calloc((size_t)n, sizeof *threads);
  for (int i = 0; i < n; i++) {
    jobs[i].engine = engine;
    jobs[i].prompt = argv[2 + i];
    jobs[i].index = i;
    pthread_create(&threads[i], NULL, run, &jobs[i]);
  }
  int rc = 0;
  for (int i = 0; i < n; i++) {
    pthread_join(threads[i], NULL);
    if (jobs[i].status != VLLM_OK) {
      fprintf(stderr, "request %d failed (%d): %s\n", i, jobs[i].status, jobs[i].error);
      rc = 1;
    }
  }
  /* the blocking streaming call: callbacks on this thread */
  vllm_sampling_params sp = vllm_sampling_params_default();
  sp.temperature = 0.0f;
  sp.max_tokens = 8;
  job last = {engine, argv[2], n, VLLM_OK, {0}};
  st = vllm_complete_stream(engine, argv[2], &sp, on_text, &last);
  if (st != VLLM_OK) {
    fprintf(stderr, "complete_stream failed (%d): %s\n", st, vllm_last_error());
    rc = 1;
  }
  vllm_engine_free(engine);
  free(jobs);
  free(threads);
  return rc;
}
