// Speculative decoding with the checkpoint's MTP head, for every executor that drafts and
// verifies (Executor::draft, Executor::verify).
#pragma once
#include "executor.h"

namespace lily {

// Each round drafts up to req.draft_tokens tokens after the pending one (with adaptive_drafts,
// as many as DraftPolicy chooses, none meaning a run of plain decode steps), feeds the pending
// token and the drafts as one verify step and keeps the drafts the model confirms, plus its
// next choice. Greedy: the longest run equal to its own argmax; a verify row is bit-identical
// to a one-token step, so the tokens are exactly plain greedy decoding's however good the
// drafts. Sampling (and penalties): rejection sampling on the host from the rows' logits,
// which keeps every token's distribution exactly the sampler's. Stop ids, max_tokens, the
// context's end and on_token's cancel end it where the plain loop would, with the session left
// as after that token.
GenerateResult speculative_loop(Executor& e, Session& s, const GenerateRequest& req, const TokenCallback& on_token);
// What speculative_loop refuses (by name), checked before generate touches the session.
void check_speculative(const Executor& e, const Session& s, const GenerateRequest& req);

}  // namespace lily
