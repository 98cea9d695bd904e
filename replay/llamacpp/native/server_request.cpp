// spec-replay-request: what llama-server makes of one request, computed by the server's own code.
//
// Our code, linked against the llama.cpp tree's own libraries (server-context, llama-common): it
// does for one request what llama-server does between receiving it and starting its slot, so a
// transcript recorded without the server's echo (`generation_settings`) can be replayed with the
// grammar, triggers and chat prompt the server really built. Nothing here reimplements a rule of the
// server's; each step calls the function the server calls, in the order it calls them:
//
//   flags            common_params_parse(..., LLAMA_EXAMPLE_SERVER)         tools/server/server.cpp:112
//   chat templates   common_chat_templates_init(model, params.chat_template) server-context.cpp:1587
//   thinking         enable_reasoning && use_jinja && template supports it   server-context.cpp:1595-1596
//   chat params      server_chat_params{...}                                 server-context.cpp:1609-1623
//   EOG biases       every llama_vocab_is_eog token at -INFINITY            common/common.cpp:1331-1338
//   chat request     oaicompat_chat_params_parse(body, chat_params, files)  server-context.cpp:5290
//   /v1/completions  oaicompat_completion_params_parse(body)                 server-context.cpp:5276
//   task settings    server_schema::eval_llama_cmpl_schema(...)              server-context.cpp:4666
//   the echo         task_params::to_json()                                 server-task.cpp (generation_settings)
//
// What it cannot do: the model file's general.sampling.* defaults (common_init_sampler_from_model
// is static in common.cpp:1088), so the sampling values of its echo are the flags' only; spec-replay
// takes the grammar, triggers, stops and prompt from it and the sampling values from its own layers.
//
// Usage: spec-replay-request -m MODEL [server flags...] < request.json
//   request.json: {"endpoint": "/v1/chat/completions", "body": {...},
//                  "renders": [{"now": 1764547200, "tz": "UTC"}, ...]}   (renders optional)
// Output (stdout, one JSON object): {"results": [{"now":..., "tz":..., "llama_params": {...},
//                                     "generation_settings": {...}} or {"error": "..."}]}
// Exit 0 with results (a request the server refuses is an "error" in its result), 2 on a bad
// invocation (flags the server refuses, a model that does not load), with one line on stderr.

#include "arg.h"
#include "chat.h"
#include "common.h"
#include "llama.h"
#include "log.h"
#include "server-common.h"
#include "server-schema.h"
#include "server-task.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

// The request's clock. The server reads it in three places: common_chat_templates_inputs' default
// member initializer (common/chat.h:262, constructed in oaicompat_chat_params_parse, linked here
// statically from server-context), common_chat_extra_context (common/chat.cpp:1080-1088, in
// libllama-common.so: the `date_string` and `datetime` every template sees) through
// std::chrono::system_clock::now(), and the template engine's context (common/jinja/runtime.h:73:
// `current_time = std::time(nullptr)`, which strftime_now formats, jinja/value.cpp:422-431) through
// libc's time(). The definitions below are the ones all three bind to (the program is linked with
// ENABLE_EXPORTS, so the dynamic linker finds them before libstdc++'s and libc's), so a template that
// reads the date renders the day the caller names, in the time zone of $TZ.
static bool   g_fixed_now = false;
static double g_now_s     = 0.0;

namespace std { namespace chrono { inline namespace _V2 {
system_clock::time_point system_clock::now() noexcept {
    if (g_fixed_now) {
        return system_clock::time_point(std::chrono::duration_cast<system_clock::duration>(std::chrono::duration<double>(g_now_s)));
    }
    timespec ts{};
    clock_gettime(CLOCK_REALTIME, &ts);
    return system_clock::time_point(std::chrono::duration_cast<system_clock::duration>(std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec)));
}
}}}

extern "C" time_t time(time_t * out) noexcept {
    time_t v;
    if (g_fixed_now) {
        v = (time_t) g_now_s;
    } else {
        timespec ts{};
        clock_gettime(CLOCK_REALTIME, &ts);
        v = ts.tv_sec;
    }
    if (out != nullptr) {
        *out = v;
    }
    return v;
}

static int fail(const std::string & msg) {
    fprintf(stderr, "spec-replay-request: %s\n", msg.c_str());
    return 2;
}

int main(int argc, char ** argv) {
    common_params params;
    // llama-server's own parser and its own table of flags: a flag it refuses is refused here
    if (!common_params_parse(argc, argv, params, LLAMA_EXAMPLE_SERVER)) {
        return fail("the server's flags do not parse");
    }
    common_log_set_verbosity_thold(-1);
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);

    std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    json req;
    try {
        req = json::parse(input);
    } catch (const std::exception & e) {
        return fail(std::string("the request on stdin is not JSON: ") + e.what());
    }

    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
    mparams.vocab_only = true;  // the templates, tokens and metadata; no weights
    llama_model * model = llama_model_load_from_file(params.model.path.c_str(), mparams);
    if (model == nullptr) {
        return fail("cannot load the model's vocabulary from " + params.model.path);
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);

    // common/common.cpp:1327-1345: ignore_eos without an EOS token is dropped; EOG biases
    if (params.sampling.ignore_eos && llama_vocab_eos(vocab) == LLAMA_TOKEN_NULL) {
        params.sampling.ignore_eos = false;
    }
    for (llama_token i = 0; i < llama_vocab_n_tokens(vocab); i++) {
        if (llama_vocab_is_eog(vocab, i)) {
            params.sampling.logit_bias_eog.push_back({i, -INFINITY});
        }
    }
    if (params.sampling.ignore_eos) {
        params.sampling.logit_bias.insert(params.sampling.logit_bias.end(),
                                          params.sampling.logit_bias_eog.begin(), params.sampling.logit_bias_eog.end());
    }

    // tools/server/server-context.cpp:1583-1623
    server_chat_params chat_params;
    try {
        common_chat_templates_ptr tmpls = common_chat_templates_init(model, params.chat_template);
        const bool supports = params.use_jinja && common_chat_templates_support_enable_thinking(tmpls.get());
        chat_params = {
            /* use_jinja             */ params.use_jinja,
            /* prefill_assistant     */ params.prefill_assistant,
            /* reasoning_format      */ params.reasoning_format,
            /* chat_template_kwargs  */ params.default_template_kwargs,
            /* tmpls                 */ std::move(tmpls),
            /* allow_image           */ false,
            /* allow_audio           */ false,
            /* allow_video           */ false,
            /* enable_thinking       */ params.enable_reasoning != 0 && supports,
            /* reasoning_budget      */ params.sampling.reasoning_budget_tokens,
            /* reasoning_budget_msg  */ params.sampling.reasoning_budget_message,
            /* media_path            */ params.media_path,
            /* force_pure_content    */ params.force_pure_content_parser,
        };
    } catch (const std::exception & e) {
        llama_model_free(model);
        return fail(std::string("the server would not start: chat template parsing error: ") + e.what());
    }

    const std::string endpoint = req.value("endpoint", std::string("/completion"));
    const bool chat = endpoint.find("chat/completions") != std::string::npos;
    const bool oai_cmpl = !chat && endpoint.find("v1/completions") != std::string::npos;
    json renders = req.contains("renders") ? req.at("renders") : json::array({json::object()});

    json results = json::array();
    for (const auto & r : renders) {
        json out = json::object();
        if (r.contains("now") && r.at("now").is_number()) {
            g_fixed_now = true;
            g_now_s     = r.at("now").get<double>();
            out["now"]  = r.at("now");
        } else {
            g_fixed_now = false;
        }
        if (r.contains("tz") && r.at("tz").is_string()) {
            setenv("TZ", r.at("tz").get<std::string>().c_str(), 1);
            out["tz"] = r.at("tz");
        }
        tzset();
        try {
            json body = req.at("body");
            json data;
            std::vector<raw_buffer> files;
            if (chat) {
                data = oaicompat_chat_params_parse(body, chat_params, files);
            } else if (oai_cmpl) {
                data = oaicompat_completion_params_parse(body);
            } else {
                data = body;
            }
            task_params tp = server_schema::eval_llama_cmpl_schema(vocab, params, params.sampling.logit_bias_eog, data);
            out["llama_params"]        = data;
            out["generation_settings"] = tp.to_json();
        } catch (const std::exception & e) {
            out["error"] = e.what();
        }
        results.push_back(out);
    }
    llama_model_free(model);
    llama_backend_free();
    json doc = json::object();
    doc["results"] = results;
    std::cout << doc.dump() << std::endl;
    return 0;
}
