/*
 * inferd_plugin.h: the inferd decoder plugin ABI, major version 1.
 *
 * A decoder plugin is a shared library that exports one symbol,
 *
 *     const struct inferd_plugin_info *inferd_plugin_entry_v1(const struct inferd_host_info *host);
 *
 * which returns a pointer to static data describing the strategies the library implements (or NULL
 * to refuse the host, after logging why through host->api->log). The major version is in the
 * symbol's name; the minor version is negotiated: the host states its own in inferd_host_info and
 * the plugin states the one it was built against in inferd_plugin_info.
 *
 * Rules that keep the ABI stable:
 *   - Every struct passed across the boundary starts with struct inferd_header {type, size, next}.
 *     Fields are only ever appended; a reader checks `size` before touching a field that a newer
 *     minor version added. `next` chains extension structs; unknown types are skipped.
 *   - Fixed-width integers only: no enums, bool, size_t or long in structs.
 *   - Arrays of plain records carry their element size in the struct that points to them.
 *   - Strings are NUL-terminated UTF-8. Memory belongs to whoever allocated it: the host copies
 *     what the plugin hands it (errors, plans) before the next call into the same session.
 *
 * The host drives batching. For each request it creates a session, then repeats:
 *   plan(session)     -> the plugin says, per sequence, which tokens to append and how many
 *                        positions' logits it wants. It must not block and changes no state the
 *                        host can see: the host may call plan again before observe (a plan
 *                        postponed to a later step, a prompt prefilled in chunks first), and
 *                        the same plan must come back.
 *   (the host merges all sessions' plans into one batch and runs the model)
 *   observe(session)  -> the plugin receives those logits and acts through host callbacks: emit
 *                        tokens, finish choices, fork / truncate / free sequences.
 * until plan reports done. plan and observe of one session are never called concurrently; calls
 * for different sessions may run on different threads. A plugin keeps no thread-local state.
 *
 * Sequences are host-owned KV-cache sequences named by opaque handles; the host checks every
 * handle, so a stale or foreign handle is an error, not memory corruption. Randomness comes from
 * the host (a counter-based generator keyed by the request's seed), so a seeded request draws the
 * same numbers whatever else runs in the batch.
 *
 * Errors: a function returns INFERD_OK or an error status, after calling api->set_error(call, msg)
 * with a message for the user. An error fails that request only.
 */
#ifndef INFERD_PLUGIN_H
#define INFERD_PLUGIN_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define INFERD_ABI_MAJOR 1
#define INFERD_ABI_MINOR 2

/* The entry symbol's name for this major version. */
#define INFERD_PLUGIN_ENTRY "inferd_plugin_entry_v1"

/* Status codes (int32_t). */
#define INFERD_OK 0
#define INFERD_ERR 1            /* failed; the message was given to set_error */
#define INFERD_ERR_INVALID 2    /* invalid argument (bad handle, bad parameters) */
#define INFERD_ERR_NO_MEMORY 3  /* out of KV blocks or memory */

/* Struct type tags (inferd_header.type). */
#define INFERD_TYPE_HOST_INFO 0x494e0001u
#define INFERD_TYPE_HOST_API 0x494e0002u
#define INFERD_TYPE_PLUGIN_INFO 0x494e0003u
#define INFERD_TYPE_STRATEGY 0x494e0004u
#define INFERD_TYPE_SESSION_INIT 0x494e0005u
#define INFERD_TYPE_PLAN 0x494e0006u
#define INFERD_TYPE_LOGITS 0x494e0007u

/* Log levels. */
#define INFERD_LOG_ERROR 1
#define INFERD_LOG_WARN 2
#define INFERD_LOG_INFO 3
#define INFERD_LOG_DEBUG 4

/* Sequence roles for seq_create. */
#define INFERD_ROLE_TARGET 0    /* the request's model */
#define INFERD_ROLE_DRAFT 1     /* the draft model bound to it (speculative decoding) */

/* Finish reasons for finish(). */
#define INFERD_FINISH_STOP 0    /* an end-of-sequence token or a natural end */
#define INFERD_FINISH_LENGTH 1  /* max_tokens reached */

/* Strategy flags. */
#define INFERD_STRATEGY_NEEDS_DRAFT 1u  /* sessions need a draft model (INFERD_ROLE_DRAFT) */

/* A sequence handle; 0 is never a valid handle. */
typedef uint64_t inferd_seq;

/* Host context of one call into the plugin; valid only during that call. */
typedef struct inferd_call inferd_call;

struct inferd_header {
    uint32_t type;     /* INFERD_TYPE_* */
    uint32_t size;     /* sizeof the struct as its writer knew it */
    const void *next;  /* extension chain, NULL when none */
};

/* Host services. Every function taking an inferd_call may only be called during the call that
 * received it. */
struct inferd_host_api {
    struct inferd_header header;
    void (*log)(inferd_call *call, int32_t level, const char *message);
    /* Records the error message of the current call (copied). */
    void (*set_error)(inferd_call *call, const char *message);
    /* A new empty sequence of the given role. */
    int32_t (*seq_create)(inferd_call *call, uint32_t role, inferd_seq *out);
    /* A copy-on-write fork of `seq`: same tokens, shared KV blocks. */
    int32_t (*seq_fork)(inferd_call *call, inferd_seq seq, inferd_seq *out);
    /* Keeps the first `len` tokens. INFERD_ERR_INVALID, changing nothing, on a model with
     * sliding-window layers when the next token would attend to positions they have already
     * released: a sequence can always be rolled back by up to 32 tokens (a speculative step's
     * rejected drafts), further only within its window. */
    int32_t (*seq_truncate)(inferd_call *call, inferd_seq seq, uint32_t len);
    int32_t (*seq_free)(inferd_call *call, inferd_seq seq);
    /* Number of tokens in the sequence (run or waiting to run). */
    int32_t (*seq_len)(inferd_call *call, inferd_seq seq, uint32_t *out);
    /* Copies up to `cap` tokens into `buf`; `*len` receives the sequence length. An image's
     * positions hold media ids, negative here (2^31 and above as unsigned), outside the
     * vocabulary: a strategy leaves them alone (no logit is theirs). */
    int32_t (*seq_tokens)(inferd_call *call, inferd_seq seq, int32_t *buf, uint32_t cap, uint32_t *len);
    /* Appends a token to the output of choice `choice` (0 <= choice < n). `logprob` is its
     * log-probability under the model at that position: the log-softmax of the target row the
     * host delivered (a response format's mask included), before the strategy's own
     * temperature, penalties and truncation, as OpenAI, vLLM and llama.cpp report them. */
    int32_t (*emit)(inferd_call *call, uint32_t choice, int32_t token, float logprob);
    /* Ends choice `choice` with an INFERD_FINISH_* reason. */
    int32_t (*finish)(inferd_call *call, uint32_t choice, uint32_t reason);
    /* 128 random bits for (stream, counter) under the request's key: Philox4x32-10 with key =
     * the 64-bit seed and counter = {counter low, counter high, stream low, stream high}. */
    int32_t (*random)(inferd_call *call, uint64_t stream, uint64_t counter, uint32_t out[4]);
    /* Adds `value` to the request's statistic `key` ([a-z0-9_]{1,64}), reported with its usage
     * (e.g. "draft_tokens", "accepted_tokens" for speculative decoding). */
    int32_t (*report)(inferd_call *call, const char *key, double value);
    /* ABI 1.1 (read it only when header.size covers it): copies up to `cap` bytes of what token
     * `token` stands for into `buf` (a special token's text, like "<|im_end|>"); `*len`
     * receives its full length. For strategies that build token masks of their own. */
    int32_t (*token_bytes)(inferd_call *call, int32_t token, uint8_t *buf, uint32_t cap, uint32_t *len);
    /* ABI 1.2 (read it only when header.size covers it): emit, with the `n_top` most probable
     * tokens at that position and their log-probabilities, most probable first (ties: lower
     * id first). For a request whose init has top_logprobs > 0 every token is emitted this way,
     * with n_top = min(top_logprobs, vocab_size); plain emit is then refused. */
    int32_t (*emit_top)(inferd_call *call, uint32_t choice, int32_t token, float logprob,
                        const int32_t *top_tokens, const float *top_logprobs, uint32_t n_top);
};

struct inferd_host_info {
    struct inferd_header header;
    uint32_t abi_major;
    uint32_t abi_minor;
    const char *host_version;
    const struct inferd_host_api *api;
};

/* What create() receives. */
struct inferd_session_init {
    struct inferd_header header;
    /* The strategy parameters as a JSON object ("{}" when none), already accepted by validate. */
    const char *params_json;
    /* The request's target sequence, holding the prompt (not yet run). */
    inferd_seq seq;
    uint32_t prompt_len;
    uint32_t vocab_size;
    /* Tokens to generate at most, per choice. */
    uint32_t max_tokens;
    /* Choices (completions) requested. */
    uint32_t n;
    /* End-of-sequence tokens. */
    const int32_t *eos;
    uint32_t n_eos;
    /* The sequence roles this request can create: bit (1 << INFERD_ROLE_*) set when available
     * (INFERD_ROLE_DRAFT only when a draft model is bound to the request's model). */
    uint32_t roles;
    uint64_t seed;
    /* 1: the client asked for log-probabilities (emit's `logprob`); 0: a strategy may skip
     * computing them and pass NAN. */
    uint32_t logprobs;
    uint32_t reserved;
    /* ABI 1.1 (read it only when header.size covers it). 1: the request has a response format
     * (a JSON schema, a grammar): the host has set the logits its grammar forbids to -INFINITY
     * in every row of the request's target sequences (and their forks) before observe sees
     * them, and refuses an emitted token or an end the grammar does not allow. A strategy that
     * samples from the rows it is given needs to do nothing more. */
    uint32_t constrained;
    /* ABI 1.2: the most probable alternatives the client wants with each token (0..20; 0
     * from an older host). When above 0, every token goes out through emit_top; a strategy
     * that cannot report them refuses the request in validate. The host sets it only for
     * plugins built for 1.2 or later and refuses the request for older ones. */
    uint32_t top_logprobs;
};

/* One sequence's part of a plan. */
struct inferd_plan_item {
    inferd_seq seq;
    /* Tokens to append to the sequence before running it (may be empty when the sequence
     * already holds tokens not yet run, like a fresh prompt). */
    const int32_t *tokens;
    uint32_t n_tokens;
    /* Logits wanted for this many last positions of what runs (0 <= n_logits <= tokens run). */
    uint32_t n_logits;
};

/* What plan() fills in. The items stay valid until the next call into the session. */
struct inferd_plan {
    struct inferd_header header;
    const struct inferd_plan_item *items;
    uint32_t n_items;
    uint32_t item_size;  /* sizeof(struct inferd_plan_item) as the plugin knows it */
    uint32_t done;       /* 1: the session has finished every choice; items are ignored */
    uint32_t reserved;
};

/* What observe() receives: for plan item i, rows[i] points to n_logits[i] rows of vocab floats. */
struct inferd_logits {
    struct inferd_header header;
    uint32_t n_items;
    uint32_t vocab_size;
    const float *const *rows;
    const uint32_t *n_logits;
};

/* One decoding strategy. */
struct inferd_strategy {
    struct inferd_header header;
    const char *name;         /* [a-z0-9_-]{1,64}, unique among loaded strategies */
    const char *description;  /* one line */
    /* JSON object documenting the parameters: {"name": "type, range, default: meaning", ...}. */
    const char *params_doc;
    uint32_t flags;           /* INFERD_STRATEGY_* */
    uint32_t reserved;
    /* Accepts or rejects a request at admission, before anything is scheduled: `init` is what
     * create() would get, with seq = 0. Unknown parameter keys and out-of-range values are
     * rejected with a message. Sequence callbacks are not available here. */
    int32_t (*validate)(inferd_call *call, const struct inferd_session_init *init);
    int32_t (*create)(inferd_call *call, const struct inferd_session_init *init, void **session);
    int32_t (*plan)(inferd_call *call, void *session, struct inferd_plan *plan);
    int32_t (*observe)(inferd_call *call, void *session, const struct inferd_logits *logits);
    void (*destroy)(void *session);
};

struct inferd_plugin_info {
    struct inferd_header header;
    uint32_t abi_major;       /* INFERD_ABI_MAJOR */
    uint32_t abi_minor;       /* the minor version the plugin was built against */
    const char *name;         /* the library's name */
    const char *version;      /* the library's version */
    const struct inferd_strategy *const *strategies;
    uint32_t n_strategies;
    uint32_t reserved;
};

typedef const struct inferd_plugin_info *(*inferd_plugin_entry_fn)(const struct inferd_host_info *host);

#ifdef __cplusplus
}
#endif

#endif /* INFERD_PLUGIN_H */
