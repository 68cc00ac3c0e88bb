// `prepare`: text or JSON Lines files -> tokenizer + token shards.
#include <iostream>
#include <memory>

#include "cli/commands.hpp"
#include "moe/tokenizer.hpp"

namespace moe::cli {

void add_prepare_command(CLI::App& app) {
  auto opt = std::make_shared<PrepareOptions>();
  CLI::App* cmd = app.add_subcommand(
      "prepare",
      "tokenize text or JSON Lines files into token shards (llm.c layout) plus the tokenizer");
  cmd->add_option("--input", opt->inputs,
                  "text files (one document each) or JSON Lines files (.jsonl: one a line)")
      ->required();
  cmd->add_option("--format", opt->format,
                  "auto (files ending in .jsonl as JSON Lines), text or jsonl (default auto)")
      ->check(CLI::IsMember({"auto", "text", "jsonl"}));
  cmd->add_option("--jsonl-key", opt->jsonl_key,
                  "the key of each JSON line that holds the document's text (default text)");
  cmd->add_option("--tokenizer", opt->tokenizer, "byte (built in) or spm (SentencePiece BPE)")
      ->check(CLI::IsMember({"byte", "spm"}));
  cmd->add_option("--vocab-size", opt->vocab_size,
                  "SentencePiece vocabulary to train (default 8000)")
      ->check(CLI::Range(16, 1 << 20));
  cmd->add_option("--spm-model", opt->spm_model,
                  "use this SentencePiece model instead of training one")
      ->check(CLI::ExistingFile);
  cmd->add_option("--out", opt->out_dir, "output directory")->required();
  cmd->add_option("--val-fraction", opt->val_fraction, "share of tokens held out (default 0.05)")
      ->check(CLI::Range(1e-6, 0.5));
  cmd->add_option("--shard-tokens", opt->shard_tokens, "tokens per shard (default 1e8)")
      ->check(CLI::Range(int64_t{1024}, int64_t{1} << 40));
  register_runner("prepare", [opt] { prepare_dataset(*opt, std::cout); });
}

}  // namespace moe::cli
