/*
 * vengine C ABI: the C half of libvengine.so.
 *
 * This file is the `set_source` preamble of the cffi embedding build
 * (capi/build.py). Every exported vllm_* function is a plain C function
 * defined here: it checks its arguments, starts the embedded Python when
 * needed and returns a real status (cffi's own Python-implemented exports
 * would return 0 == VLLM_OK when Python failed to start).
 *
 * Request state lives here, in C: a malloc'd struct with atomics, a mutex, a
 * condition variable, a queue of deltas and the error string, so done / error /
 * wait / cancel never take the GIL. Python pushes one batch of deltas per
 * engine step (vg_push); a small process-wide pool of C delivery threads (or
 * the caller's own thread, for the blocking calls) runs the host callbacks, in
 * order, never two at once for one request: a request is owned by at most one
 * delivery thread at a time, and a pool monitor adds a thread when every
 * delivery thread is stuck in a callback while other requests wait (see "the
 * delivery pool"). Aborts and the engine-death watchdog run on one C control
 * thread per engine, the only library thread that takes the GIL.
 *
 * Engine handles (vllm_engine*) are small records that are never freed: the
 * engine behind one is released by vllm_engine_free, the record stays, so a
 * handle used after vllm_engine_free is refused with VLLM_ERR_RUNTIME instead
 * of reading freed memory, and a later engine never gets the same address.
 *
 * Build-time defines (from capi/build.py): VG_PYTHON_EXECUTABLE,
 * VG_LIBPYTHON_SONAME, VG_VERSION.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "vllm.h"

/* ------------------------------------------------------------------------ */
/* shared with Python (also declared in capi/_cdef.h)                        */

typedef struct vg_delta {
  void* req;                 /* vllm_request* */
  const char* text;          /* delta text, text_len bytes (not NUL-terminated) */
  int64_t text_len;
  const int32_t* token_ids;  /* delta token ids */
  int32_t n_tokens;
  int32_t finished;          /* 1: last delta of the request */
  int32_t status;            /* vllm_status of a finished request */
  int32_t prompt_tokens;     /* prompt length in tokens (or -1) */
  const char* finish_reason; /* NUL-terminated or NULL */
  const char* error;         /* NUL-terminated or NULL */
} vg_delta;

#define VG_ERRLEN 4096

/* Implemented in Python (capi/_impl.py); generated after this preamble. */
static int32_t _vg_py_ready(char* err, int32_t errlen);
static int32_t _vg_py_load(const vllm_model_params* p, int64_t* eng_id, char* model_name,
                           int32_t namelen, char* err, int32_t errlen);
static int32_t _vg_py_submit(int64_t eng_id, void* req, uint64_t num, const char* prompt,
                             const int32_t* toks, int32_t ntoks, const vllm_sampling_params* sp,
                             char* err, int32_t errlen);
static int32_t _vg_py_submit_chat(int64_t eng_id, void* req, uint64_t num, const char* json,
                                  int32_t stream, char* err, int32_t errlen);
static int32_t _vg_py_default_params(int64_t eng_id, vllm_sampling_params* out, char* err,
                                     int32_t errlen);
static void _vg_py_abort(int64_t eng_id, const uint64_t* nums, int32_t n);
static void _vg_py_poll(int64_t eng_id);
static void _vg_py_engine_free(int64_t eng_id);

/* ------------------------------------------------------------------------ */
/* errors                                                                    */

static _Thread_local char vg_tls_err[VG_ERRLEN];

static void vg_set_err(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void vg_set_err(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(vg_tls_err, sizeof vg_tls_err, fmt, ap);
  va_end(ap);
}
static void vg_clear_err(void) { vg_tls_err[0] = '\0'; }

static vllm_status vg_fail(vllm_status st, const char* msg) {
  vg_set_err("%s", msg);
  return st;
}

static char* vg_strdup(const char* s) {
  size_t n = strlen(s);
  char* d = (char*)malloc(n + 1);
  if (d) memcpy(d, s, n + 1);
  return d;
}

/* ------------------------------------------------------------------------ */
/* signals                                                                   */
/*
 * The embedded interpreter is started without signal handlers, so the host's
 * signal dispositions stand, SIGPIPE's included (a Python program ignores it;
 * a C host usually keeps the default: terminate). The engine talks to its
 * engine process over a socket, and a write after that process died raised
 * SIGPIPE and killed the host (seen in test_engine_death_fails_requests: rc -13
 * in vllm_engine_free, 1 run in 6). So:
 *  - every call into Python from a host thread runs with SIGPIPE blocked in
 *    that thread (the write fails with EPIPE, which Python reports), and a
 *    SIGPIPE raised for the thread meanwhile is consumed before the host's mask
 *    comes back; threads Python starts meanwhile inherit the mask;
 *  - the library's own threads (engine control, delivery pool, its monitor, the
 *    exit helper) start with every signal blocked, so the host's signals go to
 *    the host's threads as before.
 */

typedef struct vg_sigpipe {
  sigset_t old;
  int pending_before;
} vg_sigpipe;

static void vg_sigpipe_block(vg_sigpipe* s) {
  sigset_t set, pend;
  sigemptyset(&set);
  sigaddset(&set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &set, &s->old);
  sigpending(&pend);
  s->pending_before = sigismember(&pend, SIGPIPE);
}

static void vg_sigpipe_restore(vg_sigpipe* s) {
  sigset_t set, pend;
  sigemptyset(&set);
  sigaddset(&set, SIGPIPE);
  sigpending(&pend);
  if (!s->pending_before && sigismember(&pend, SIGPIPE)) {
    struct timespec zero = {0, 0};
    while (sigtimedwait(&set, NULL, &zero) < 0 && errno == EINTR) {
    }
  }
  pthread_sigmask(SIG_SETMASK, &s->old, NULL);
}

/* Start a library thread with every signal blocked; 1 on success. */
static int vg_thread_start(pthread_t* t, int detached, void* (*fn)(void*), void* arg) {
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pthread_attr_t a;
  pthread_attr_init(&a);
  if (detached) pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
  int rc = pthread_create(t, &a, fn, arg);
  pthread_attr_destroy(&a);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  return rc == 0;
}

/* ------------------------------------------------------------------------ */
/* process state                                                             */

static atomic_int g_py_started;   /* 1 once Python has been started in this process */
static atomic_int g_forked;       /* 1 in a child forked after Python started */
static atomic_int g_exiting;      /* 1 once the atexit handler ran: no more callbacks */
static atomic_uint_fast64_t g_next_req = 1;

static pthread_once_t g_py_once = PTHREAD_ONCE_INIT;
static vllm_status g_py_status = VLLM_ERR_RUNTIME;
static char g_py_msg[VG_ERRLEN];

/* Every engine handle ever returned (never freed; see struct vllm_engine). */
static pthread_mutex_t g_engines_mu = PTHREAD_MUTEX_INITIALIZER;
static vllm_engine* g_engines;
static pthread_once_t g_atexit_once = PTHREAD_ONCE_INIT;

/* Exit handling. glibc's on_exit() passes the exit status to the handler, which
 * a forked child needs (vg_exit_handler); elsewhere atexit() and no status. */
static void vg_exit_handler(int status, int status_known);
#ifdef __GLIBC__
static void vg_on_exit(int status, void* arg) {
  (void)arg;
  vg_exit_handler(status, 1);
}
static void vg_register_exit_handler(void) { on_exit(vg_on_exit, NULL); }
#else
static void vg_atexit(void) { vg_exit_handler(0, 0); }
static void vg_register_exit_handler(void) { atexit(vg_atexit); }
#endif

/* Before fork(), in the parent: register the exit handler once more, so that in
 * the child it is the last one registered before the fork and runs before the
 * handlers of the libraries Python loaded (libtorch's wait for a GIL held by a
 * thread that does not exist in the child). Registering here, not in the child
 * handler, takes glibc's exit-handler lock while every thread still exists. */
static void vg_atfork_prepare(void) {
  if (atomic_load(&g_py_started) && !atomic_load(&g_forked)) vg_register_exit_handler();
}

static void vg_atfork_child(void) {
  if (atomic_load(&g_py_started)) atomic_store(&g_forked, 1);
}

__attribute__((constructor)) static void vg_ctor(void) {
  /* A host that dlopen()s us with RTLD_LOCAL hides libpython's symbols from the
   * extension modules Python will import (torch, ...). Promote it to global. */
  (void)dlopen(VG_LIBPYTHON_SONAME, RTLD_NOW | RTLD_NOLOAD | RTLD_GLOBAL);
  pthread_atfork(vg_atfork_prepare, NULL, vg_atfork_child);
}

static int vg_check_fork(void) {
  if (atomic_load(&g_forked)) {
    vg_set_err("vengine: called in a child process forked after the engine's Python runtime "
               "started; the engine threads do not exist here. Load the library in the child "
               "before starting Python in the parent, or exec a new program.");
    return 1;
  }
  return 0;
}

/* cffi (< Python 3.12) uses PyCapsule_Type.tp_version_tag as a spin lock that
 * must read 0; the type cache gives the type a tag as soon as anything looks up
 * an attribute on a capsule (a sitecustomize importing torch did, in a test),
 * and cffi's start-up then asserts (or spins forever without asserts).
 * PyType_Modified resets the tag and invalidates the type's cache entries. */
static void vg_reset_cffi_lock(void) {
#if PY_VERSION_HEX < 0x030C0000
  if (PyCapsule_Type.tp_version_tag != 0) PyType_Modified(&PyCapsule_Type);
#endif
}

static void vg_py_start_once(void) {
  if (!Py_IsInitialized()) {
    PyConfig config;
    PyConfig_InitPythonConfig(&config);
    config.install_signal_handlers = 0;
    config.parse_argv = 0;
    const char* exe = getenv("VENGINE_PYTHON");
    if (!exe || !*exe) exe = VG_PYTHON_EXECUTABLE;
    PyStatus st = PyConfig_SetBytesString(&config, &config.executable, exe);
    if (!PyStatus_Exception(st)) st = PyConfig_SetBytesString(&config, &config.program_name, exe);
    if (!PyStatus_Exception(st)) st = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(st)) {
      snprintf(g_py_msg, sizeof g_py_msg,
               "vengine: the embedded Python (executable %s; set VENGINE_PYTHON to change it) "
               "failed to start: %s%s%s",
               exe, st.func ? st.func : "", st.func ? ": " : "", st.err_msg ? st.err_msg : "?");
      g_py_status = VLLM_ERR_RUNTIME;
      return;
    }
    atomic_store(&g_py_started, 1);
    vg_reset_cffi_lock();
    PyEval_SaveThread(); /* release the GIL; cffi re-acquires it per call */
  } else {
    atomic_store(&g_py_started, 1);
    PyGILState_STATE g = PyGILState_Ensure();
    vg_reset_cffi_lock();
    PyGILState_Release(g);
  }
  if (cffi_start_python() != 0) {
    snprintf(g_py_msg, sizeof g_py_msg,
             "vengine: the embedded Python started but libvengine's init code failed "
             "(traceback on stderr)");
    g_py_status = VLLM_ERR_RUNTIME;
    return;
  }
  char buf[VG_ERRLEN];
  buf[0] = '\0';
  if (_vg_py_ready(buf, (int32_t)sizeof buf) != 1) {
    snprintf(g_py_msg, sizeof g_py_msg,
             "vengine: the embedded Python could not import the engine (check VENGINE_PYTHON, "
             "VENGINE_PYTHONPATH, PYTHONHOME, PYTHONPATH): %s",
             buf[0] ? buf : "Python-side initialization did not run");
    g_py_status = VLLM_ERR_RUNTIME;
    return;
  }
  g_py_status = VLLM_OK;
}

/* Starts Python once per process; returns VLLM_OK or sets the thread's error. */
static vllm_status vg_py_start(void) {
  vg_sigpipe sp;
  vg_sigpipe_block(&sp);
  pthread_once(&g_py_once, vg_py_start_once);
  vg_sigpipe_restore(&sp);
  if (g_py_status != VLLM_OK) vg_set_err("%s", g_py_msg);
  return g_py_status;
}

/* ------------------------------------------------------------------------ */
/* engine and request structs                                                */

typedef struct vg_node {
  struct vg_node* next;
  char* text; /* NUL-terminated */
  size_t text_len;
  int32_t* toks;
  int32_t ntoks;
  int32_t finished;
  int32_t status;
  int32_t prompt_tokens;
  const char* finish_reason; /* static */
  char* error;               /* malloc'd or NULL */
} vg_node;

/* A loaded engine: reference counted, released when the host's handle is freed
 * and every request made on it has been freed. */
typedef struct vg_engine {
  int64_t id; /* key of the Python-side bridge */
  char model_name[256];
  atomic_int refs; /* the host's handle + one per request + calls in progress */
  atomic_int live; /* requests whose final delta has not arrived yet */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint64_t* aborts; /* request numbers to abort (control thread) */
  size_t naborts, capaborts;
  int stop;
  pthread_t ctl;
} vg_engine;

/* What a vllm_engine* points to: a record that is never freed (a few bytes per
 * vllm_engine_load), on the g_engines list. `core` is NULL once the handle was
 * freed; both fields are guarded by g_engines_mu. */
struct vllm_engine {
  vg_engine* core;
  vllm_engine* next;
};

/* VG_MODE_POOL: vllm_request_submit, callbacks on the delivery pool.
 * VG_MODE_PUMP: blocking calls, callbacks on the caller's thread. */
enum { VG_MODE_POOL = 0, VG_MODE_PUMP = 1 };

/* Where a pool request stands with the delivery pool (guarded by the request's
 * mu): HELD until its submit succeeded (nothing is delivered before), IDLE with
 * nothing to deliver, QUEUED on the pool's ready queue, RUNNING on a delivery
 * thread (which owns it: deltas that arrive meanwhile wait for that thread). */
enum { VG_HELD = 0, VG_IDLE = 1, VG_QUEUED = 2, VG_RUNNING = 3 };

struct vllm_request {
  vg_engine* eng;
  uint64_t num;
  int mode;
  vllm_token_callback cb;
  void* ud;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  vg_node *head, *tail;
  int sched;                 /* VG_HELD ... (pool mode) */
  vllm_request* ready_next;  /* the pool's ready queue (while QUEUED) */
  atomic_int refs;        /* host handle (or pump caller) + Python until the final delta
                             (+ the delivery pool until the final callback returned) */
  atomic_int cancelled;   /* host asked to stop */
  atomic_int terminal_in; /* the final delta was pushed */
  atomic_int done;        /* the final callback returned */
  atomic_int in_cb;       /* a callback of this request is running ... */
  pthread_t cb_thread;    /* ... on this thread */
  /* results, valid once done */
  vllm_status status;
  char* error;
  const char* finish_reason;
  int32_t prompt_tokens;
  int32_t completion_tokens;
};

static const char* vg_reason(const char* r) {
  static const char* const known[] = {"stop", "length", "abort", "error", "tool_calls"};
  if (!r) return NULL;
  for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
    if (strcmp(r, known[i]) == 0) return known[i];
  return "stop";
}

static void vg_node_free(vg_node* n) {
  if (!n) return;
  free(n->text);
  free(n->toks);
  free(n->error);
  free(n);
}

static void vg_engine_decref(vg_engine* e) {
  if (atomic_fetch_sub(&e->refs, 1) != 1) return;
  pthread_mutex_destroy(&e->mu);
  pthread_cond_destroy(&e->cv);
  free(e->aborts);
  free(e);
}

static void vg_req_decref(vllm_request* r) {
  if (atomic_fetch_sub(&r->refs, 1) != 1) return;
  vg_node* n = r->head;
  while (n) {
    vg_node* nx = n->next;
    vg_node_free(n);
    n = nx;
  }
  free(r->error);
  pthread_mutex_destroy(&r->mu);
  pthread_cond_destroy(&r->cv);
  vg_engine* e = r->eng;
  free(r);
  vg_engine_decref(e);
}

/* A new request on engine `e`; takes over the caller's reference on `e` (on
 * failure too). */
static vllm_request* vg_req_new(vg_engine* e, int mode, vllm_token_callback cb, void* ud) {
  vllm_request* r = (vllm_request*)calloc(1, sizeof *r);
  if (!r) {
    vg_engine_decref(e);
    return NULL;
  }
  r->eng = e;
  r->num = atomic_fetch_add(&g_next_req, 1);
  r->mode = mode;
  r->cb = cb;
  r->ud = ud;
  pthread_mutex_init(&r->mu, NULL);
  pthread_cond_init(&r->cv, NULL);
  atomic_init(&r->refs, mode == VG_MODE_POOL ? 3 : 2); /* caller + Python (+ the pool) */
  r->sched = VG_HELD;
  r->status = VLLM_OK;
  r->prompt_tokens = -1;
  atomic_fetch_add(&e->live, 1);
  return r;
}

/* Ask the control thread to abort request `num` in the engine. Never blocks on
 * Python. */
static void vg_engine_queue_abort(vg_engine* e, uint64_t num) {
  pthread_mutex_lock(&e->mu);
  if (!e->stop) {
    if (e->naborts == e->capaborts) {
      size_t cap = e->capaborts ? e->capaborts * 2 : 16;
      uint64_t* a = (uint64_t*)realloc(e->aborts, cap * sizeof *a);
      if (a) {
        e->aborts = a;
        e->capaborts = cap;
      }
    }
    if (e->naborts < e->capaborts) e->aborts[e->naborts++] = num;
    pthread_cond_signal(&e->cv);
  }
  pthread_mutex_unlock(&e->mu);
}

static void vg_cancel_internal(vllm_request* r) {
  if (atomic_exchange(&r->cancelled, 1)) return;
  if (atomic_load(&r->terminal_in)) return;
  vg_engine_queue_abort(r->eng, r->num);
}

/* The delivery pool's ready queue (defined below). */
static void vg_pool_push(vllm_request* first, vllm_request* last, int n);

/* Append one node to a request's queue (takes ownership of n). Called by
 * vg_push (from Python, GIL released). Releases Python's reference on the
 * final delta. Returns 1 when a pool request went from IDLE to QUEUED: the
 * caller must put it on the pool's ready queue (it owns r->ready_next then). */
static int vg_req_enqueue(vllm_request* r, vg_node* n) {
  int fin = n->finished;
  if (fin && atomic_exchange(&r->terminal_in, 1)) { /* a second final delta: drop */
    vg_node_free(n);
    return 0;
  }
  vg_engine* e = r->eng;
  pthread_mutex_lock(&r->mu);
  if (r->tail)
    r->tail->next = n;
  else
    r->head = n;
  r->tail = n;
  int schedule = r->mode == VG_MODE_POOL && r->sched == VG_IDLE;
  if (schedule) {
    r->sched = VG_QUEUED;
    r->ready_next = NULL;
  }
  pthread_cond_broadcast(&r->cv); /* a pump caller waits here */
  pthread_mutex_unlock(&r->mu);
  if (fin) {
    atomic_fetch_sub(&e->live, 1);
    /* never the last reference while r is being scheduled: a pool request keeps
     * the pool's reference until its final callback returned, which needs this
     * node delivered first */
    vg_req_decref(r);
  }
  return schedule;
}

static vg_node* vg_node_make(const char* text, size_t len, const int32_t* toks, int32_t ntoks) {
  vg_node* n = (vg_node*)calloc(1, sizeof *n);
  if (!n) return NULL;
  n->text = (char*)malloc(len + 1);
  if (!n->text) {
    free(n);
    return NULL;
  }
  if (len) memcpy(n->text, text, len);
  n->text[len] = '\0';
  n->text_len = len;
  if (ntoks > 0 && toks) {
    n->toks = (int32_t*)malloc(sizeof(int32_t) * (size_t)ntoks);
    if (n->toks) {
      memcpy(n->toks, toks, sizeof(int32_t) * (size_t)ntoks);
      n->ntoks = ntoks;
    }
  }
  n->prompt_tokens = -1;
  return n;
}

/* exit() runs handlers in reverse registration order, and C++ libraries loaded
 * by Python (libtorch, ...) register destructors of function-local statics the
 * first time a code path runs, i.e. during the first engine steps, after our
 * registration at load; those destructors would then run while the engine
 * thread still computes ("unknown parameter type" from torch, seen in a test).
 * So the handler is registered again at the 1st, 2nd, 4th, 8th, ... step pushed
 * (a log-bounded number of entries); only its first run does work. */
static atomic_uint_fast64_t g_pushes;

/* One engine step's worth of deltas, from Python. The pool requests that became
 * ready go on the pool's ready queue in one batch (one lock, a few wake-ups). */
static void vg_push(const vg_delta* d, int32_t n) {
  uint64_t k = atomic_fetch_add(&g_pushes, 1) + 1;
  if ((k & (k - 1)) == 0) vg_register_exit_handler();
  vllm_request *first = NULL, *last = NULL;
  int nready = 0;
  for (int32_t i = 0; i < n; i++) {
    vllm_request* r = (vllm_request*)d[i].req;
    vg_node* node = vg_node_make(d[i].text, (size_t)d[i].text_len, d[i].token_ids, d[i].n_tokens);
    if (!node && d[i].finished) node = vg_node_make("", 0, NULL, 0); /* the end must arrive */
    if (!node) {
      if (!d[i].finished) continue;
      abort();
    }
    node->finished = d[i].finished;
    node->status = d[i].status;
    node->prompt_tokens = d[i].prompt_tokens;
    node->finish_reason = vg_reason(d[i].finish_reason);
    if (d[i].error && d[i].error[0]) node->error = vg_strdup(d[i].error);
    if (vg_req_enqueue(r, node)) {
      if (last)
        last->ready_next = r;
      else
        first = r;
      last = r;
      nready++;
    }
  }
  if (nready) vg_pool_push(first, last, nready);
}

/* ------------------------------------------------------------------------ */
/* delivery                                                                  */

typedef struct vg_buf {
  char* p;
  size_t n, cap;
  int oom;
} vg_buf;

static void vg_buf_add(vg_buf* b, const char* s, size_t n) {
  if (b->oom) return;
  if (b->n + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + n + 1) cap *= 2;
    char* p = (char*)realloc(b->p, cap);
    if (!p) {
      b->oom = 1;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
  memcpy(b->p + b->n, s, n);
  b->n += n;
  b->p[b->n] = '\0';
}
static void vg_buf_str(vg_buf* b, const char* s) { vg_buf_add(b, s, strlen(s)); }

/* Append text for a C string: NUL characters (a byte-level tokenizer can produce
 * them) become U+FFFD. */
static void vg_buf_text(vg_buf* b, const char* s, size_t n) {
  size_t start = 0;
  for (size_t i = 0; i < n; i++) {
    if (s[i] != '\0') continue;
    vg_buf_add(b, s + start, i - start);
    vg_buf_add(b, "\xEF\xBF\xBD", 3);
    start = i + 1;
  }
  vg_buf_add(b, s + start, n - start);
}

/* A handler sees every delta of a request in order, on one thread at a time. It
 * returns false to cancel the request. `finished` comes exactly once, last. */
typedef bool (*vg_handler)(void* ctx, vllm_request* r, const vg_node* n, bool cancelled);

/* Deliver a list of nodes taken off r's queue, in order. Returns 1 when the list
 * held the final delta: r is then done (waiters woken) and the caller must not
 * deliver again. */
static int vg_deliver_list(vllm_request* r, vg_node* n, vg_handler h, void* ctx) {
  while (n) {
    vg_node* next = n->next;
    int fin = n->finished;
    if (n->prompt_tokens >= 0) r->prompt_tokens = n->prompt_tokens;
    r->completion_tokens += n->ntoks;
    if (fin) {
      r->status = (vllm_status)n->status;
      r->finish_reason = n->finish_reason;
      r->error = n->error;
      n->error = NULL;
    }
    bool cancelled = atomic_load(&r->cancelled) != 0;
    if (!atomic_load(&g_exiting)) {
      r->cb_thread = pthread_self();
      atomic_store(&r->in_cb, 1);
      bool keep = h(ctx, r, n, cancelled);
      atomic_store(&r->in_cb, 0);
      if (!keep && !fin) vg_cancel_internal(r);
    }
    vg_node_free(n);
    if (fin) {
      for (n = next; n; n = next) { /* nothing follows a final delta; be safe */
        next = n->next;
        vg_node_free(n);
      }
      pthread_mutex_lock(&r->mu);
      atomic_store(&r->done, 1);
      pthread_cond_broadcast(&r->cv);
      pthread_mutex_unlock(&r->mu);
      return 1;
    }
    n = next;
  }
  return 0;
}

/* Take every node queued on r (waiting for one). */
static vg_node* vg_take_wait(vllm_request* r) {
  pthread_mutex_lock(&r->mu);
  while (!r->head) pthread_cond_wait(&r->cv, &r->mu);
  vg_node* n = r->head;
  r->head = r->tail = NULL;
  pthread_mutex_unlock(&r->mu);
  return n;
}

/* The blocking calls: deliver on the caller's thread until the final delta. */
static void vg_deliver(vllm_request* r, vg_handler h, void* ctx) {
  while (!vg_deliver_list(r, vg_take_wait(r), h, ctx)) {
  }
}

static int vg_in_own_callback(const vllm_request* r) {
  return atomic_load(&r->in_cb) && pthread_equal(r->cb_thread, pthread_self());
}

/* The host-callback handler: text deltas, then one ("", true). Text that
 * arrives after a cancel is dropped. */
static bool vg_host_handler(void* ctx, vllm_request* r, const vg_node* n, bool cancelled) {
  (void)ctx;
  if (!r->cb) return true;
  bool keep = true;
  if (!cancelled && n->text && n->text_len > 0) {
    if (memchr(n->text, 0, n->text_len)) { /* C strings cannot carry NUL: U+FFFD */
      vg_buf b;
      memset(&b, 0, sizeof b);
      vg_buf_text(&b, n->text, n->text_len);
      keep = b.oom ? true : r->cb(b.p, false, r->ud);
      free(b.p);
    } else {
      keep = r->cb(n->text, false, r->ud);
    }
    if (!keep) vg_cancel_internal(r);
  }
  if (n->finished) r->cb("", true, r->ud);
  return keep;
}

/* ------------------------------------------------------------------------ */
/* the delivery pool                                                         */
/*
 * The callbacks of vllm_request_submit requests run on a small process-wide
 * pool of delivery threads, not one thread per request. A request with deltas
 * waiting is on the FIFO ready queue once; a delivery thread takes it, delivers
 * what it holds, in order, and puts it back at the tail if more arrived
 * meanwhile. So requests take turns, a request is owned by at most one thread
 * at a time (its callbacks never overlap), and none runs on an engine thread or
 * with the GIL (these threads never take it).
 *
 * Threads start on demand, up to VENGINE_DELIVERY_THREADS (default 4). A slow
 * callback holds its thread but no other request: requests wait on the shared
 * queue, not behind a thread, and when requests wait while no delivery thread
 * has taken one for VG_STALL_MS (every thread is inside a callback), the
 * monitor thread adds a thread, up to VENGINE_DELIVERY_THREADS_MAX (default 64).
 * Threads beyond the first VENGINE_DELIVERY_THREADS exit after VG_IDLE_EXIT_S
 * seconds without work.
 */
#define VG_STALL_MS 20
#define VG_IDLE_EXIT_S 2

typedef struct vg_pool {
  pthread_mutex_t mu;
  pthread_cond_t work; /* delivery threads: a request is ready */
  pthread_cond_t mon;  /* the monitor: requests are ready and no thread is idle */
  vllm_request *head, *tail;
  int nthreads, nidle, core, max;
  uint64_t taken; /* requests taken off the ready queue so far (progress) */
  int ok;         /* the monitor and a first delivery thread started */
} vg_pool;

static vg_pool g_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                         PTHREAD_COND_INITIALIZER, NULL, NULL, 0, 0, 0, 0, 0, 0};
static pthread_once_t g_pool_once = PTHREAD_ONCE_INIT;

static void vg_deadline(struct timespec* ts, long ms) {
  clock_gettime(CLOCK_REALTIME, ts);
  ts->tv_sec += ms / 1000;
  ts->tv_nsec += (ms % 1000) * 1000000L;
  if (ts->tv_nsec >= 1000000000L) {
    ts->tv_sec += 1;
    ts->tv_nsec -= 1000000000L;
  }
}

/* One slice of a pool request's delivery: what is queued now. */
static void vg_pool_run(vllm_request* r) {
  pthread_mutex_lock(&r->mu);
  r->sched = VG_RUNNING;
  vg_node* n = r->head;
  r->head = r->tail = NULL;
  pthread_mutex_unlock(&r->mu);
  if (vg_deliver_list(r, n, vg_host_handler, NULL)) {
    vg_req_decref(r); /* the pool's reference */
    return;
  }
  pthread_mutex_lock(&r->mu);
  int again = r->head != NULL;
  r->sched = again ? VG_QUEUED : VG_IDLE;
  r->ready_next = NULL;
  pthread_mutex_unlock(&r->mu);
  if (again) vg_pool_push(r, r, 1); /* back of the queue: the others take their turn */
}

static void* vg_pool_main(void* arg) {
  (void)arg;
  pthread_setname_np(pthread_self(), "vengine-deliver");
  vg_pool* P = &g_pool;
  pthread_mutex_lock(&P->mu);
  for (;;) {
    if (!P->head) {
      struct timespec dl;
      vg_deadline(&dl, VG_IDLE_EXIT_S * 1000L);
      int rc = 0;
      P->nidle++;
      while (!P->head && rc != ETIMEDOUT) rc = pthread_cond_timedwait(&P->work, &P->mu, &dl);
      P->nidle--;
      if (!P->head) {
        if (P->nthreads > P->core) break;
        continue;
      }
    }
    vllm_request* r = P->head;
    P->head = r->ready_next;
    if (!P->head) P->tail = NULL;
    P->taken++;
    if (P->head && P->nidle == 0) pthread_cond_signal(&P->mon); /* work left, nobody idle */
    pthread_mutex_unlock(&P->mu);
    vg_pool_run(r);
    pthread_mutex_lock(&P->mu);
  }
  P->nthreads--;
  pthread_mutex_unlock(&P->mu);
  return NULL;
}

/* Start one delivery thread (caller holds the pool's mu). */
static int vg_pool_spawn_locked(vg_pool* P) {
  pthread_t t;
  int ok = vg_thread_start(&t, 1, vg_pool_main, NULL);
  if (ok) P->nthreads++;
  return ok;
}

/* Adds a delivery thread when requests wait and none was taken for VG_STALL_MS
 * while no thread is idle: every delivery thread is inside a (slow) callback. */
static void* vg_pool_monitor(void* arg) {
  (void)arg;
  pthread_setname_np(pthread_self(), "vengine-monitor");
  vg_pool* P = &g_pool;
  pthread_mutex_lock(&P->mu);
  for (;;) {
    while (!(P->head && P->nidle == 0)) pthread_cond_wait(&P->mon, &P->mu);
    uint64_t seen = P->taken;
    struct timespec dl;
    vg_deadline(&dl, VG_STALL_MS);
    int rc = 0;
    while (rc != ETIMEDOUT && P->head && P->nidle == 0 && P->taken == seen)
      rc = pthread_cond_timedwait(&P->mon, &P->mu, &dl);
    if (P->head && P->nidle == 0 && P->taken == seen && P->nthreads < P->max)
      vg_pool_spawn_locked(P);
  }
  return NULL;
}

static int vg_env_int(const char* name, int dflt, int lo, int hi) {
  const char* s = getenv(name);
  if (!s || !*s) return dflt;
  long v = strtol(s, NULL, 10);
  return v < lo ? lo : v > hi ? hi : (int)v;
}

static void vg_pool_start_once(void) {
  vg_pool* P = &g_pool;
  P->core = vg_env_int("VENGINE_DELIVERY_THREADS", 4, 1, 1024);
  P->max = vg_env_int("VENGINE_DELIVERY_THREADS_MAX", 64, 1, 4096);
  if (P->max < P->core) P->max = P->core;
  pthread_t t;
  int ok = vg_thread_start(&t, 1, vg_pool_monitor, NULL);
  pthread_mutex_lock(&P->mu);
  P->ok = ok && vg_pool_spawn_locked(P);
  pthread_mutex_unlock(&P->mu);
}

/* Starts the pool once per process; 0 if its threads could not be created. */
static int vg_pool_ready(void) {
  pthread_once(&g_pool_once, vg_pool_start_once);
  return g_pool.ok;
}

/* Put n ready requests (a chain through ready_next) at the tail of the queue. */
static void vg_pool_push(vllm_request* first, vllm_request* last, int n) {
  vg_pool* P = &g_pool;
  pthread_mutex_lock(&P->mu);
  if (P->tail)
    P->tail->ready_next = first;
  else
    P->head = first;
  P->tail = last;
  last->ready_next = NULL;
  int wake = n < P->nidle ? n : P->nidle;
  if (wake == P->nidle)
    pthread_cond_broadcast(&P->work);
  else
    for (int i = 0; i < wake; i++) pthread_cond_signal(&P->work);
  int uncovered = n - wake;
  while (uncovered > 0 && P->nthreads < P->core && vg_pool_spawn_locked(P)) uncovered--;
  if (uncovered > 0) pthread_cond_signal(&P->mon);
  pthread_mutex_unlock(&P->mu);
}

/* A pool request whose submit succeeded: deliver what arrived meanwhile. */
static void vg_pool_release_held(vllm_request* r) {
  pthread_mutex_lock(&r->mu);
  int ready = r->head != NULL;
  r->sched = ready ? VG_QUEUED : VG_IDLE;
  r->ready_next = NULL;
  pthread_mutex_unlock(&r->mu);
  if (ready) vg_pool_push(r, r, 1);
}

/* ------------------------------------------------------------------------ */
/* engine control thread: aborts and the engine-death watchdog               */

static void* vg_ctl_main(void* arg) {
  vg_engine* e = (vg_engine*)arg;
  pthread_setname_np(pthread_self(), "vengine-control");
  pthread_mutex_lock(&e->mu);
  for (;;) {
    if (e->stop) break;
    if (e->naborts > 0) {
      size_t n = e->naborts;
      uint64_t* a = (uint64_t*)malloc(n * sizeof *a);
      if (a) memcpy(a, e->aborts, n * sizeof *a);
      e->naborts = 0;
      pthread_mutex_unlock(&e->mu);
      if (a) _vg_py_abort(e->id, a, (int32_t)n);
      free(a);
      pthread_mutex_lock(&e->mu);
      continue;
    }
    if (atomic_load(&e->live) > 0) {
      struct timespec ts;
      vg_deadline(&ts, 250);
      int rc = pthread_cond_timedwait(&e->cv, &e->mu, &ts);
      if (rc == ETIMEDOUT && !e->stop && e->naborts == 0 && atomic_load(&e->live) > 0) {
        pthread_mutex_unlock(&e->mu);
        _vg_py_poll(e->id); /* fails every live request if the engine died */
        pthread_mutex_lock(&e->mu);
      }
    } else {
      pthread_cond_wait(&e->cv, &e->mu);
    }
  }
  pthread_mutex_unlock(&e->mu);
  return NULL;
}

static void vg_engine_wake(vg_engine* e) {
  pthread_mutex_lock(&e->mu);
  pthread_cond_signal(&e->cv);
  pthread_mutex_unlock(&e->mu);
}

/* ------------------------------------------------------------------------ */
/* exit                                                                      */

static pthread_mutex_t g_exit_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_exit_cv = PTHREAD_COND_INITIALIZER;
static int g_exit_done;

/* The first engine handle not freed yet, or NULL. */
static vllm_engine* vg_first_live_engine(void) {
  pthread_mutex_lock(&g_engines_mu);
  vllm_engine* h = g_engines;
  while (h && !h->core) h = h->next;
  pthread_mutex_unlock(&g_engines_mu);
  return h;
}

static void* vg_exit_main(void* arg) {
  (void)arg;
  for (vllm_engine* h; (h = vg_first_live_engine()) != NULL;) vllm_engine_free(h);
  pthread_mutex_lock(&g_exit_mu);
  g_exit_done = 1;
  pthread_cond_broadcast(&g_exit_cv);
  pthread_mutex_unlock(&g_exit_mu);
  return NULL;
}

/* At exit.
 * - In a child forked after the engine's Python started: flush stdio and end the
 *   process now with the status given to exit(). The exit handlers registered
 *   before the fork (libtorch's among them) are not fork-safe: one waits for a
 *   GIL held by a thread that does not exist in the child (seen hanging 2 times
 *   in 10). vg_atfork_prepare registered this handler last before the fork, so
 *   only handlers the child registered itself run before it.
 * - Otherwise, for hosts that exit without vllm_engine_free: stop and join the
 *   engine threads with a bounded wait, so nothing runs while the process tears
 *   down. Python is never finalized. */
static void vg_exit_handler(int status, int status_known) {
  if (atomic_load(&g_forked)) {
    if (status_known) {
      fflush(NULL);
      _exit(status);
    }
    return;
  }
  if (atomic_exchange(&g_exiting, 1)) return;
  if (!vg_first_live_engine()) return;
  double timeout = 10.0;
  const char* t = getenv("VENGINE_EXIT_TIMEOUT");
  if (t && *t) timeout = atof(t);
  pthread_t th;
  if (!vg_thread_start(&th, 0, vg_exit_main, NULL)) return;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_sec += (time_t)timeout;
  ts.tv_nsec += (long)((timeout - (double)(time_t)timeout) * 1e9);
  if (ts.tv_nsec >= 1000000000L) {
    ts.tv_sec += 1;
    ts.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&g_exit_mu);
  int rc = 0;
  while (!g_exit_done && rc != ETIMEDOUT) rc = pthread_cond_timedwait(&g_exit_cv, &g_exit_mu, &ts);
  int ok = g_exit_done;
  pthread_mutex_unlock(&g_exit_mu);
  if (ok)
    pthread_join(th, NULL);
  else {
    fprintf(stderr, "vengine: engine shutdown at exit did not finish within %.1fs; exiting anyway\n",
            timeout);
    pthread_detach(th);
  }
}


/* ------------------------------------------------------------------------ */
/* exported API                                                              */

#define VG_EXPORT __attribute__((visibility("default")))

VG_EXPORT const char* vllm_last_error(void) { return vg_tls_err; }
VG_EXPORT const char* vllm_version(void) { return VG_VERSION; }
VG_EXPORT int32_t vllm_abi_version(void) { return VLLM_ABI_VERSION; }

VG_EXPORT void vllm_model_params_init(vllm_model_params* p) {
  if (!p) return;
  memset(p, 0, sizeof *p);
  p->gpu_memory_utilization = 0.9;
}

VG_EXPORT void vllm_sampling_params_init(vllm_sampling_params* p) {
  if (!p) return;
  memset(p, 0, sizeof *p);
  p->temperature = 1.0f;
  p->top_p = 1.0f;
  p->top_k = 0;
  p->min_p = 0.0f;
  p->max_tokens = 16;
  p->repetition_penalty = 1.0f;
}

VG_EXPORT vllm_model_params vllm_model_params_default(void) {
  vllm_model_params p;
  vllm_model_params_init(&p);
  return p;
}

VG_EXPORT vllm_sampling_params vllm_sampling_params_default(void) {
  vllm_sampling_params p;
  vllm_sampling_params_init(&p);
  return p;
}

VG_EXPORT void vllm_string_free(char* s) { free(s); }

VG_EXPORT void vllm_completion_free(vllm_completion* c) {
  if (!c) return;
  free(c->text);
  memset(c, 0, sizeof *c);
}

VG_EXPORT vllm_status vllm_engine_load(const vllm_model_params* params, vllm_engine** out) {
  vg_clear_err();
  if (out) *out = NULL;
  if (!params) return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_engine_load: params is NULL");
  if (!out) return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_engine_load: out is NULL");
  if (!params->model_path || !params->model_path[0])
    return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_engine_load: params->model_path is NULL or empty");
  if (vg_check_fork()) return VLLM_ERR_RUNTIME;
  vllm_status st = vg_py_start();
  if (st != VLLM_OK) return st;

  vllm_engine* h = (vllm_engine*)calloc(1, sizeof *h);
  vg_engine* e = (vg_engine*)calloc(1, sizeof *e);
  if (!h || !e) {
    free(h);
    free(e);
    return vg_fail(VLLM_ERR_RUNTIME, "vllm_engine_load: out of memory");
  }
  pthread_mutex_init(&e->mu, NULL);
  pthread_cond_init(&e->cv, NULL);
  atomic_init(&e->refs, 1);
  char err[VG_ERRLEN];
  err[0] = '\0';
  vg_sigpipe sp;
  vg_sigpipe_block(&sp);
  st = (vllm_status)_vg_py_load(params, &e->id, e->model_name, (int32_t)sizeof e->model_name, err,
                                (int32_t)sizeof err);
  int ctl = st == VLLM_OK && vg_thread_start(&e->ctl, 0, vg_ctl_main, e);
  if (st == VLLM_OK && !ctl) _vg_py_engine_free(e->id);
  vg_sigpipe_restore(&sp);
  if (st != VLLM_OK || !ctl) {
    vg_engine_decref(e);
    free(h);
    if (st != VLLM_OK) {
      vg_set_err("%s", err[0] ? err : "vllm_engine_load failed");
      return st;
    }
    return vg_fail(VLLM_ERR_RUNTIME, "vllm_engine_load: could not start the control thread");
  }
  pthread_once(&g_atexit_once, vg_register_exit_handler);
  pthread_mutex_lock(&g_engines_mu);
  h->core = e;
  h->next = g_engines;
  g_engines = h;
  pthread_mutex_unlock(&g_engines_mu);
  *out = h;
  return VLLM_OK;
}

/* Look a handle up among the handles ever returned (the handle itself is not
 * read unless it is one) and detach (`detach`) or take a reference on its
 * engine. NULL when the handle is unknown or freed; *known says which. */
static vg_engine* vg_engine_lookup(vllm_engine* h, int detach, int* known) {
  pthread_mutex_lock(&g_engines_mu);
  vllm_engine* x = g_engines;
  while (x && x != h) x = x->next;
  vg_engine* e = x ? x->core : NULL;
  if (e) {
    if (detach)
      x->core = NULL;
    else
      atomic_fetch_add(&e->refs, 1);
  }
  pthread_mutex_unlock(&g_engines_mu);
  *known = x != NULL;
  return e;
}

VG_EXPORT void vllm_engine_free(vllm_engine* h) {
  if (!h) return;
  vg_clear_err();
  if (atomic_load(&g_forked)) return;
  int known;
  vg_engine* e = vg_engine_lookup(h, 1, &known);
  if (!e) {
    vg_set_err(known ? "vllm_engine_free: the engine was already freed"
                     : "vllm_engine_free: not an engine handle from vllm_engine_load");
    return;
  }
  /* Python: abort what is live, shut the engine down (joins its threads), end
   * every request still live with a final delta. */
  vg_sigpipe sp;
  vg_sigpipe_block(&sp);
  _vg_py_engine_free(e->id);
  vg_sigpipe_restore(&sp);
  pthread_mutex_lock(&e->mu);
  e->stop = 1;
  pthread_cond_signal(&e->cv);
  pthread_mutex_unlock(&e->mu);
  pthread_join(e->ctl, NULL);
  vg_engine_decref(e);
}

/* The engine behind a handle, with a reference the caller passes on to a
 * request (vg_req_new) or drops; NULL with *st and the thread's error set when
 * the handle is NULL, unknown or freed, or in a forked child. */
static vg_engine* vg_engine_acquire(vllm_engine* h, const char* fn, vllm_status* st) {
  *st = VLLM_OK;
  if (!h) {
    vg_set_err("%s: engine is NULL", fn);
    *st = VLLM_ERR_INVALID_ARGUMENT;
    return NULL;
  }
  if (vg_check_fork()) {
    *st = VLLM_ERR_RUNTIME;
    return NULL;
  }
  int known;
  vg_engine* e = vg_engine_lookup(h, 0, &known);
  if (!e && known) {
    vg_set_err("%s: the engine was freed (vllm_engine_free)", fn);
    *st = VLLM_ERR_RUNTIME;
  } else if (!e) {
    vg_set_err("%s: not an engine handle from vllm_engine_load", fn);
    *st = VLLM_ERR_INVALID_ARGUMENT;
  }
  return e;
}

VG_EXPORT vllm_status vllm_engine_sampling_params_default(vllm_engine* h, vllm_sampling_params* out) {
  static const char fn[] = "vllm_engine_sampling_params_default";
  vg_clear_err();
  if (!out) return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_engine_sampling_params_default: out is NULL");
  vllm_status st;
  vg_engine* e = vg_engine_acquire(h, fn, &st);
  if (!e) return st;
  vllm_sampling_params p;
  vllm_sampling_params_init(&p);
  char err[VG_ERRLEN];
  err[0] = '\0';
  vg_sigpipe sp;
  vg_sigpipe_block(&sp);
  st = (vllm_status)_vg_py_default_params(e->id, &p, err, (int32_t)sizeof err);
  vg_sigpipe_restore(&sp);
  vg_engine_decref(e);
  if (st != VLLM_OK) {
    vg_set_err("%s: %s", fn, err[0] ? err : "failed");
    return st;
  }
  *out = p; /* untouched on failure */
  return VLLM_OK;
}

/* Start a request in the engine. On success the request is live and Python
 * holds its reference; on failure the request is released and the thread's
 * error is set. */
static vllm_status vg_start(vllm_request* r, const char* prompt, const int32_t* toks,
                            int32_t ntoks, const vllm_sampling_params* sp, const char* chat_json,
                            int32_t chat_stream) {
  char err[VG_ERRLEN];
  err[0] = '\0';
  vllm_status st;
  vg_sigpipe sig;
  vg_sigpipe_block(&sig);
  if (chat_json)
    st = (vllm_status)_vg_py_submit_chat(r->eng->id, r, r->num, chat_json, chat_stream, err,
                                         (int32_t)sizeof err);
  else
    st = (vllm_status)_vg_py_submit(r->eng->id, r, r->num, prompt, toks, ntoks, sp, err,
                                    (int32_t)sizeof err);
  vg_sigpipe_restore(&sig);
  if (st != VLLM_OK) {
    vg_set_err("%s", err[0] ? err : "request submission failed");
    /* Python does not hold it: drop Python's reference (unless a final delta was
     * pushed meanwhile, e.g. by a concurrent vllm_engine_free) and the caller's. */
    if (!atomic_exchange(&r->terminal_in, 1)) {
      atomic_fetch_sub(&r->eng->live, 1);
      vg_req_decref(r);
    }
    if (r->mode == VG_MODE_POOL) vg_req_decref(r); /* never scheduled: no callback */
    vg_req_decref(r);
    return st;
  }
  vg_engine_wake(r->eng); /* the watchdog runs while requests are live */
  if (r->mode == VG_MODE_POOL) vg_pool_release_held(r);
  return VLLM_OK;
}

VG_EXPORT vllm_status vllm_request_submit(vllm_engine* e, const char* prompt,
                                          const vllm_sampling_params* params,
                                          vllm_token_callback cb, void* user_data,
                                          vllm_request** out) {
  vg_clear_err();
  if (out) *out = NULL;
  if (!prompt) return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_request_submit: prompt is NULL");
  if (!params) return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_request_submit: params is NULL");
  if (!out) return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_request_submit: out is NULL");
  vllm_status st;
  vg_engine* g = vg_engine_acquire(e, "vllm_request_submit", &st);
  if (!g) return st;
  if (!vg_pool_ready()) {
    vg_engine_decref(g);
    return vg_fail(VLLM_ERR_RUNTIME, "vllm_request_submit: could not start the delivery threads");
  }
  vllm_request* r = vg_req_new(g, VG_MODE_POOL, cb, user_data);
  if (!r) return vg_fail(VLLM_ERR_RUNTIME, "vllm_request_submit: out of memory");
  st = vg_start(r, prompt, NULL, 0, params, NULL, 0);
  if (st != VLLM_OK) return st;
  *out = r;
  return VLLM_OK;
}

VG_EXPORT vllm_status vllm_request_cancel(vllm_request* r) {
  vg_clear_err();
  if (!r) return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_request_cancel: request is NULL");
  if (vg_check_fork()) return VLLM_ERR_RUNTIME;
  vg_cancel_internal(r);
  return VLLM_OK;
}

VG_EXPORT vllm_status vllm_request_wait(vllm_request* r) {
  vg_clear_err();
  if (!r) return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_request_wait: request is NULL");
  if (vg_check_fork()) return VLLM_ERR_RUNTIME;
  if (vg_in_own_callback(r))
    return vg_fail(VLLM_ERR_INVALID_ARGUMENT,
                   "vllm_request_wait: called from the request's own callback (it would wait for "
                   "itself); use vllm_request_cancel there and wait from another thread");
  pthread_mutex_lock(&r->mu);
  while (!atomic_load(&r->done)) pthread_cond_wait(&r->cv, &r->mu);
  pthread_mutex_unlock(&r->mu);
  if (r->status != VLLM_OK) vg_set_err("%s", r->error ? r->error : "request failed");
  return r->status;
}

VG_EXPORT bool vllm_request_done(const vllm_request* r) {
  return r ? atomic_load(&((vllm_request*)r)->done) != 0 : false;
}

VG_EXPORT const char* vllm_request_error(const vllm_request* r) {
  if (!r || !atomic_load(&((vllm_request*)r)->done) || !r->error) return "";
  return r->error;
}

VG_EXPORT void vllm_request_free(vllm_request* r) {
  if (!r) return;
  vg_clear_err();
  if (atomic_load(&g_forked)) return; /* the delivery thread does not exist here */
  if (vg_in_own_callback(r)) {
    vg_set_err("vllm_request_free: called from the request's own callback; the handle was NOT "
               "freed. Use vllm_request_cancel there and free from another thread");
    return;
  }
  if (!atomic_load(&r->done)) vg_cancel_internal(r);
  pthread_mutex_lock(&r->mu);
  while (!atomic_load(&r->done)) pthread_cond_wait(&r->cv, &r->mu);
  pthread_mutex_unlock(&r->mu);
  vg_req_decref(r);
}

/* ---- blocking calls: submit + a pump loop on the caller's thread --------- */

typedef struct vg_collect {
  vg_buf text;
  int raw; /* keep NUL characters (chat JSON escapes them) */
  int32_t* toks;
  int32_t ntoks, cap;
} vg_collect;

static bool vg_collect_handler(void* ctx, vllm_request* r, const vg_node* n, bool cancelled) {
  (void)r;
  (void)cancelled;
  vg_collect* c = (vg_collect*)ctx;
  if (n->text_len) {
    if (c->raw)
      vg_buf_add(&c->text, n->text, n->text_len);
    else
      vg_buf_text(&c->text, n->text, n->text_len);
  }
  if (n->ntoks > 0 && c->toks != NULL) {
    int32_t room = c->cap - c->ntoks;
    int32_t k = n->ntoks < room ? n->ntoks : room;
    if (k > 0) memcpy(c->toks + c->ntoks, n->toks, sizeof(int32_t) * (size_t)k);
    c->ntoks += k;
  }
  return true;
}

static vllm_status vg_finish_pump(vllm_request* r) {
  vllm_status st = r->status;
  if (st != VLLM_OK) vg_set_err("%s", r->error ? r->error : "request failed");
  vg_req_decref(r);
  return st;
}

static vllm_status vg_complete_impl(vllm_engine* h, const char* fn, const char* prompt,
                                    const int32_t* ptoks, int32_t nptoks,
                                    const vllm_sampling_params* params, int32_t* out_toks,
                                    int32_t max_out, int32_t* n_out, vllm_completion* out) {
  vllm_status st;
  vg_engine* e = vg_engine_acquire(h, fn, &st);
  if (!e) return st;
  vllm_request* r = vg_req_new(e, VG_MODE_PUMP, NULL, NULL);
  if (!r) {
    vg_set_err("%s: out of memory", fn);
    return VLLM_ERR_RUNTIME;
  }
  st = vg_start(r, prompt, ptoks, nptoks, params, NULL, 0);
  if (st != VLLM_OK) return st;
  vg_collect c;
  memset(&c, 0, sizeof c);
  c.toks = out_toks;
  c.cap = out_toks ? max_out : 0;
  vg_deliver(r, vg_collect_handler, &c);
  if (n_out) *n_out = c.ntoks;
  if (out) {
    if (!c.text.p) vg_buf_str(&c.text, "");
    out->text = c.text.p;
    c.text.p = NULL;
    out->finish_reason = r->finish_reason;
    out->prompt_tokens = r->prompt_tokens < 0 ? 0 : r->prompt_tokens;
    out->completion_tokens = r->completion_tokens;
  }
  free(c.text.p);
  if (r->status != VLLM_OK) {
    if (out) vllm_completion_free(out);
    if (n_out) *n_out = 0;
  }
  return vg_finish_pump(r);
}

VG_EXPORT vllm_status vllm_complete(vllm_engine* e, const char* prompt,
                                   const vllm_sampling_params* params, vllm_completion* out) {
  vg_clear_err();
  if (out) memset(out, 0, sizeof *out);
  if (!e) return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_complete: engine is NULL");
  if (!prompt) return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_complete: prompt is NULL");
  if (!params) return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_complete: params is NULL");
  if (!out) return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_complete: out is NULL");
  return vg_complete_impl(e, "vllm_complete", prompt, NULL, 0, params, NULL, 0, NULL, out);
}

VG_EXPORT vllm_status vllm_complete_tokens(vllm_engine* e, const int32_t* prompt_tokens,
                                           int32_t n_prompt_tokens,
                                           const vllm_sampling_params* params, int32_t* out_tokens,
                                           int32_t max_out_tokens, int32_t* n_out_tokens,
                                           vllm_completion* out) {
  vg_clear_err();
  if (out) memset(out, 0, sizeof *out);
  if (n_out_tokens) *n_out_tokens = 0;
  if (!e) return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_complete_tokens: engine is NULL");
  if (!prompt_tokens || n_prompt_tokens <= 0)
    return vg_fail(VLLM_ERR_INVALID_ARGUMENT,
                   "vllm_complete_tokens: prompt_tokens is NULL or n_prompt_tokens <= 0");
  if (!params) return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_complete_tokens: params is NULL");
  if (max_out_tokens < 0 || (max_out_tokens > 0 && !out_tokens))
    return vg_fail(VLLM_ERR_INVALID_ARGUMENT,
                   "vllm_complete_tokens: out_tokens is NULL with max_out_tokens > 0, or "
                   "max_out_tokens < 0");
  if (!n_out_tokens)
    return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_complete_tokens: n_out_tokens is NULL");
  return vg_complete_impl(e, "vllm_complete_tokens", NULL, prompt_tokens, n_prompt_tokens, params,
                          out_tokens, max_out_tokens, n_out_tokens, out);
}

VG_EXPORT vllm_status vllm_complete_stream(vllm_engine* e, const char* prompt,
                                          const vllm_sampling_params* params,
                                          vllm_token_callback cb, void* user_data) {
  vg_clear_err();
  if (!prompt) return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_complete_stream: prompt is NULL");
  if (!params) return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_complete_stream: params is NULL");
  if (!cb) return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_complete_stream: cb is NULL");
  vllm_status st;
  vg_engine* g = vg_engine_acquire(e, "vllm_complete_stream", &st);
  if (!g) return st;
  vllm_request* r = vg_req_new(g, VG_MODE_PUMP, cb, user_data);
  if (!r) return vg_fail(VLLM_ERR_RUNTIME, "vllm_complete_stream: out of memory");
  st = vg_start(r, prompt, NULL, 0, params, NULL, 0);
  if (st != VLLM_OK) return st;
  vg_deliver(r, vg_host_handler, NULL);
  return vg_finish_pump(r);
}

/* ---- chat ----------------------------------------------------------------- */

/* The chat request's OpenAI JSON is built in Python by the protocol layer the HTTP server
 * uses (pyengine.entrypoints.openai.serving_chat.ChatStream): a streamed request's deltas
 * carry its chat.completion.chunk objects, one per line; a plain one's final delta carries
 * the chat.completion object. */

typedef struct vg_chat_stream_ctx {
  int stopped; /* the host returned false */
} vg_chat_stream_ctx;

static bool vg_chat_stream_handler(void* ctx, vllm_request* r, const vg_node* n, bool cancelled) {
  vg_chat_stream_ctx* c = (vg_chat_stream_ctx*)ctx;
  bool keep = true;
  size_t start = 0;
  while (!cancelled && !c->stopped && start < n->text_len) {
    const char* nl = memchr(n->text + start, '\n', n->text_len - start);
    size_t end = nl ? (size_t)(nl - n->text) : n->text_len;
    if (end > start) {
      vg_buf b;
      memset(&b, 0, sizeof b);
      vg_buf_add(&b, n->text + start, end - start);
      keep = b.oom ? true : r->cb(b.p, false, r->ud);
      free(b.p);
      if (!keep) c->stopped = 1;
    }
    start = end + 1;
  }
  if (n->finished) r->cb("", true, r->ud);
  return keep;
}

static vllm_status vg_chat_start(vllm_engine* h, const char* fn, const char* json,
                                 vllm_token_callback cb, void* ud, vllm_request** rr,
                                 int32_t stream) {
  if (!json) {
    vg_set_err("%s: request_json is NULL", fn);
    return VLLM_ERR_INVALID_ARGUMENT;
  }
  vllm_status st;
  vg_engine* e = vg_engine_acquire(h, fn, &st);
  if (!e) return st;
  vllm_request* r = vg_req_new(e, VG_MODE_PUMP, cb, ud);
  if (!r) {
    vg_set_err("%s: out of memory", fn);
    return VLLM_ERR_RUNTIME;
  }
  st = vg_start(r, NULL, NULL, 0, NULL, json, stream);
  if (st != VLLM_OK) return st;
  *rr = r;
  return VLLM_OK;
}

VG_EXPORT vllm_status vllm_chat(vllm_engine* e, const char* request_json, char** out_response_json) {
  vg_clear_err();
  if (out_response_json) *out_response_json = NULL;
  if (!e) return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_chat: engine is NULL");
  if (!out_response_json)
    return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_chat: out_response_json is NULL");
  vllm_request* r = NULL;
  vllm_status st = vg_chat_start(e, "vllm_chat", request_json, NULL, NULL, &r, 0);
  if (st != VLLM_OK) return st;
  vg_collect c;
  memset(&c, 0, sizeof c);
  c.raw = 1;
  vg_deliver(r, vg_collect_handler, &c);
  if (r->status == VLLM_OK) {
    if (c.text.oom || !c.text.p) {
      free(c.text.p);
      vg_req_decref(r);
      return vg_fail(VLLM_ERR_RUNTIME, c.text.oom ? "vllm_chat: out of memory" : "vllm_chat: no response");
    }
    while (c.text.n > 0 && c.text.p[c.text.n - 1] == '\n') c.text.p[--c.text.n] = '\0';
    *out_response_json = c.text.p;
    c.text.p = NULL;
  }
  free(c.text.p);
  return vg_finish_pump(r);
}

VG_EXPORT vllm_status vllm_chat_stream(vllm_engine* e, const char* request_json,
                                      vllm_token_callback cb, void* user_data) {
  vg_clear_err();
  if (!e) return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_chat_stream: engine is NULL");
  if (!cb) return vg_fail(VLLM_ERR_INVALID_ARGUMENT, "vllm_chat_stream: cb is NULL");
  vllm_request* r = NULL;
  vg_chat_stream_ctx ctx;
  memset(&ctx, 0, sizeof ctx);
  vllm_status st = vg_chat_start(e, "vllm_chat_stream", request_json, cb, user_data, &r, 1);
  if (st != VLLM_OK) return st;
  vg_deliver(r, vg_chat_stream_handler, &ctx);
  return vg_finish_pump(r);
}
