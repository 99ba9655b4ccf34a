/*
 * A decoding strategy written in C against inferd_plugin.h: greedy decoding, strategy "c-greedy".
 * The end-to-end tests compile it with the system C compiler and check that it decodes exactly
 * like the Rust greedy plugin. Built with one of the FAULT_* macros it becomes one of the broken
 * plugins the host must refuse or survive:
 *   FAULT_MAJOR2      exports only an ABI 2 entry point
 *   FAULT_NO_ENTRY    exports no entry point at all
 *   FAULT_NEWER_MINOR claims to be built for a newer minor version than the host speaks
 *   FAULT_REFUSE      the entry point returns NULL
 *   FAULT_BAD_NAME    declares an invalid strategy name
 *   FAULT_NO_OBSERVE  leaves a required function out
 *   FAULT_OLD_SIZE    declares a strategy struct smaller than ABI 1.0's
 *   FAULT_BAD_HANDLE  plans with a sequence handle it never received
 *   FAULT_FAIL_PLAN   fails every plan with an error message
 * and, for the isolation of plugins in a helper process, once two tokens have gone out:
 *   FAULT_SEGV        writes through a null pointer in observe
 *   FAULT_ABORT       calls abort() in observe
 *   FAULT_HANG        never returns from plan
 *   FAULT_HUGE_ALLOC  allocates and fills 20 GiB in observe (an error when refused)
 * or, built with SCRIPT, strategy "c-script": it writes the token ids of its parameters,
 * {"tokens": [ID, ...]}, whatever the logits say (ending as greedy does at an end token, or
 * when the script runs out), so that a test can make a model answer a given text;
 * or when it starts:
 *   FAULT_CRASH_LOAD  writes through a null pointer in its entry point
 *   FAULT_ESCAPE      in create, tries to open a file, to open an IP socket and to signal the
 *                     process that started it; it fails the request naming what worked
 */
#ifdef FAULT_ESCAPE
#define _POSIX_C_SOURCE 200809L
#endif
#include <stdlib.h>
#include <string.h>
#include "inferd_plugin.h"
#ifdef FAULT_ESCAPE
#include <signal.h>
#include <stdio.h>
#include <sys/socket.h>
#include <unistd.h>
#endif

/* Once two tokens have gone out: the moment the fault macros strike. */
#define STRIKE(s) ((s)->emitted == 2)

static const struct inferd_host_api *api;

struct session {
    inferd_seq seq;
    uint32_t max_tokens, emitted, started, done;
    int32_t last;
    uint32_t n_eos;
    int32_t eos[8];
    struct inferd_plan_item item;
#ifdef SCRIPT
    uint32_t n_script;
    int32_t script[512];
#endif
};

static int32_t validate(inferd_call *call, const struct inferd_session_init *init) {
#ifdef SCRIPT
    if (!strstr(init->params_json, "\"tokens\"")) {
        api->set_error(call, "c-script takes {\"tokens\": [ID, ...]}");
        return INFERD_ERR_INVALID;
    }
    return INFERD_OK;
#endif
    if (strcmp(init->params_json, "{}") != 0 && strcmp(init->params_json, "") != 0) {
        api->set_error(call, "c-greedy takes no parameters");
        return INFERD_ERR_INVALID;
    }
    return INFERD_OK;
}

static int32_t create(inferd_call *call, const struct inferd_session_init *init, void **out) {
#ifdef FAULT_ESCAPE
    FILE *f = fopen("/etc/hostname", "r");
    if (f) {
        fclose(f);
        api->set_error(call, "escaped: opened /etc/hostname");
        return INFERD_ERR;
    }
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd >= 0) {
        close(fd);
        api->set_error(call, "escaped: opened an IP socket");
        return INFERD_ERR;
    }
    if (kill(getppid(), 0) == 0) {
        api->set_error(call, "escaped: may signal the process that started it");
        return INFERD_ERR;
    }
#endif
    struct session *s = calloc(1, sizeof *s);
    if (!s) {
        api->set_error(call, "out of memory");
        return INFERD_ERR_NO_MEMORY;
    }
    s->seq = init->seq;
    s->max_tokens = init->max_tokens;
    s->done = init->max_tokens == 0;
    s->n_eos = init->n_eos < 8 ? init->n_eos : 8;
    for (uint32_t i = 0; i < s->n_eos; i++) s->eos[i] = init->eos[i];
#ifdef SCRIPT
    /* The numbers after "tokens", in order. */
    const char *p = strstr(init->params_json, "\"tokens\"");
    while (p && *p && *p != ']' && s->n_script < 512) {
        if (*p >= '0' && *p <= '9') {
            char *end;
            s->script[s->n_script++] = (int32_t)strtol(p, &end, 10);
            p = end;
        } else {
            p++;
        }
    }
#endif
    *out = s;
    return INFERD_OK;
}

static int32_t plan(inferd_call *call, void *session, struct inferd_plan *plan) {
    struct session *s = session;
#ifdef FAULT_FAIL_PLAN
    api->set_error(call, "c-greedy was built to fail");
    return INFERD_ERR;
#endif
    (void)call;
#ifdef FAULT_HANG
    if (STRIKE(s)) {
        volatile int spin = 1;
        while (spin) {
        }
    }
#endif
    if (s->done) {
        plan->done = 1;
        plan->n_items = 0;
        return INFERD_OK;
    }
    s->item.seq = s->seq;
#ifdef FAULT_BAD_HANDLE
    s->item.seq = s->seq + 1000;
#endif
    s->item.tokens = s->started ? &s->last : NULL;
    s->item.n_tokens = s->started ? 1 : 0;
    s->item.n_logits = 1;
    plan->items = &s->item;
    plan->n_items = 1;
    plan->item_size = sizeof s->item;
    plan->done = 0;
    return INFERD_OK;
}

static int32_t observe(inferd_call *call, void *session, const struct inferd_logits *logits) {
    struct session *s = session;
    if (logits->n_items != 1 || logits->n_logits[0] != 1) {
        api->set_error(call, "expected one row of logits");
        return INFERD_ERR;
    }
#ifdef FAULT_SEGV
    if (STRIKE(s)) *(volatile int *)(uintptr_t)0 = 1;
#endif
#ifdef FAULT_ABORT
    if (STRIKE(s)) abort();
#endif
#ifdef FAULT_HUGE_ALLOC
    if (STRIKE(s)) {
        size_t huge = (size_t)20 << 30;
        char *p = malloc(huge);
        if (!p) {
            api->set_error(call, "could not allocate 20 GiB");
            return INFERD_ERR_NO_MEMORY;
        }
        memset(p, 1, huge);
        free(p);
    }
#endif
    const float *row = logits->rows[0];
    int32_t best = 0;
    for (uint32_t i = 1; i < logits->vocab_size; i++)
        if (row[i] > row[best]) best = (int32_t)i;
#ifdef SCRIPT
    if (s->emitted >= s->n_script) {
        s->done = 1;
        return api->finish(call, 0, INFERD_FINISH_STOP);
    }
    best = s->script[s->emitted];
#endif
    s->started = 1;
    for (uint32_t i = 0; i < s->n_eos; i++) {
        if (s->eos[i] == best) {
            s->done = 1;
            return api->finish(call, 0, INFERD_FINISH_STOP);
        }
    }
    int32_t st = api->emit(call, 0, best, 0.0f);
    if (st != INFERD_OK) return st;
    s->last = best;
    if (++s->emitted >= s->max_tokens) {
        s->done = 1;
        return api->finish(call, 0, INFERD_FINISH_LENGTH);
    }
    return INFERD_OK;
}

static void destroy(void *session) { free(session); }

static const struct inferd_strategy strategy = {
#ifdef FAULT_OLD_SIZE
    .header = {INFERD_TYPE_STRATEGY, 24, NULL},
#else
    .header = {INFERD_TYPE_STRATEGY, sizeof(struct inferd_strategy), NULL},
#endif
#ifdef FAULT_BAD_NAME
    .name = "C Greedy!",
#elif defined(SCRIPT)
    .name = "c-script",
#else
    .name = "c-greedy",
#endif
#ifdef SCRIPT
    .description = "Writes the tokens it is given, written in C",
    .params_doc = "{\"tokens\": \"the token ids to write, in order\"}",
#else
    .description = "Greedy decoding, written in C",
    .params_doc = "{}",
#endif
    .validate = validate,
    .create = create,
    .plan = plan,
#ifndef FAULT_NO_OBSERVE
    .observe = observe,
#else
    .reserved = sizeof(&observe) == 0,
#endif
    .destroy = destroy,
};

static const struct inferd_strategy *const strategies[] = {&strategy};

static const struct inferd_plugin_info info = {
    .header = {INFERD_TYPE_PLUGIN_INFO, sizeof(struct inferd_plugin_info), NULL},
    .abi_major = INFERD_ABI_MAJOR,
#ifdef FAULT_NEWER_MINOR
    .abi_minor = INFERD_ABI_MINOR + 1,
#else
    .abi_minor = 0,
#endif
    .name = "c-greedy",
    .version = "1.0",
    .strategies = strategies,
    .n_strategies = 1,
};

#if defined(FAULT_NO_ENTRY)
const struct inferd_plugin_info *not_an_entry(void);
const struct inferd_plugin_info *not_an_entry(void) { return &info; }
#elif defined(FAULT_MAJOR2)
const struct inferd_plugin_info *inferd_plugin_entry_v2(const struct inferd_host_info *host);
const struct inferd_plugin_info *inferd_plugin_entry_v2(const struct inferd_host_info *host) {
    (void)host;
    return &info;
}
#else
const struct inferd_plugin_info *inferd_plugin_entry_v1(const struct inferd_host_info *host);
const struct inferd_plugin_info *inferd_plugin_entry_v1(const struct inferd_host_info *host) {
    if (host->abi_major != INFERD_ABI_MAJOR || host->header.size < sizeof *host) return NULL;
    api = host->api;
#ifdef FAULT_CRASH_LOAD
    *(volatile int *)(uintptr_t)0 = 1;
#endif
#ifdef FAULT_REFUSE
    api->log(NULL, INFERD_LOG_ERROR, "c-greedy refuses every host");
    return NULL;
#endif
    return &info;
}
#endif
