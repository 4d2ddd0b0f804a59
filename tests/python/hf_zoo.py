"""Hugging Face transformers models with small configs and random weights, as a user
would build them (no weights are downloaded): BERT, GPT-2, Llama, T5, ViT, Swin, ConvBERT,
Mixtral, gpt-oss (attention sinks, sliding windows, experts), DeepSeek-V3 (latent attention,
routed and shared experts), Qwen3-Next (gated linear attention beside full attention) and
wav2vec2 with its CTC head.

    model, args, kwargs = hf_zoo.make("hf_gpt2", batch=4)
"""
import torch

SEQ = 16
VOCAB = 96


def _lm_batch(batch, g, seq, vocab=VOCAB):
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return ids


def make(name, batch=4, seed=0, length=None):
    """`length`: the sequence length of the language models (default SEQ)."""
    import transformers as tf
    seq = length or SEQ
    tf.logging.set_verbosity_error()
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the weights
    small = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if name == "hf_bert":
        cfg = tf.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                            num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=32,
                            **small)
        ids = _lm_batch(batch, g, seq)
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[:, seq - 3:] = (torch.arange(batch) % 2).unsqueeze(1)  # some padding
        return tf.BertForMaskedLM(cfg), (), {"input_ids": ids, "attention_mask": mask,
                                             "labels": _lm_batch(batch, g, seq)}
    if name == "hf_gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=VOCAB,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
        ids = _lm_batch(batch, g, seq)
        return tf.GPT2LMHeadModel(cfg), (), {"input_ids": ids, "labels": ids}
    if name == "hf_llama":
        cfg = tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                             max_position_embeddings=32, use_cache=False)
        ids = _lm_batch(batch, g, seq)
        return tf.LlamaForCausalLM(cfg), (), {"input_ids": ids, "labels": ids}
    if name == "hf_t5":
        cfg = tf.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=4,
                          d_kv=8, vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0,
                          pad_token_id=0, use_cache=False)
        return tf.T5ForConditionalGeneration(cfg), (), {
            "input_ids": _lm_batch(batch, g, seq), "labels": _lm_batch(batch, g, seq - 4)}
    if name == "hf_vit":
        cfg = tf.ViTConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                           num_attention_heads=4, image_size=16, patch_size=4, num_labels=5,
                           **small)
        return tf.ViTForImageClassification(cfg), (), {
            "pixel_values": torch.randn(batch, 3, 16, 16, generator=g),
            "labels": torch.randint(0, 5, (batch,), generator=g)}
    if name == "hf_swin":  # shifted windows: masks and relative positions from index ops
        cfg = tf.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 1],
                            num_heads=[2, 2], window_size=4, num_labels=5, drop_path_rate=0.0,
                            **small)
        return tf.SwinForImageClassification(cfg), (), {
            "pixel_values": torch.randn(batch, 3, 32, 32, generator=g),
            "labels": torch.randint(0, 5, (batch,), generator=g)}
    if name == "hf_convbert":  # x += self.bias after a convolution: a write into a fresh value
        cfg = tf.ConvBertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                num_attention_heads=4, embedding_size=32, vocab_size=VOCAB,
                                max_position_embeddings=32, **small)
        return tf.ConvBertForMaskedLM(cfg), (), {
            "input_ids": _lm_batch(batch, g, seq), "labels": _lm_batch(batch, g, seq)}
    if name == "hf_mixtral":  # mixture of experts in its fixed-shape form (docs/api.md)
        # transformers 4 has only the eager loop over the experts the batch hits, which a
        # trace fixes at its length (an error at a batch that misses one, docs/status.md):
        # there every token goes to every expert (likely why hf_mixtral failed on the H200)
        top_k = 2 if int(tf.__version__.split(".")[0]) >= 5 else 4
        cfg = tf.MixtralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                               max_position_embeddings=32, num_local_experts=4,
                               num_experts_per_tok=top_k, use_cache=False,
                               experts_implementation="batched_mm")
        ids = _lm_batch(batch, g, seq)
        return tf.MixtralForCausalLM(cfg), (), {"input_ids": ids, "labels": ids}
    decoder = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                   vocab_size=VOCAB, max_position_embeddings=32, use_cache=False)
    if name == "hf_gpt_oss":  # attention sinks; a sliding layer and a full one; grouped_mm experts
        cfg = tf.GptOssConfig(**decoder, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                              num_experts_per_tok=2, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"])
        ids = _lm_batch(batch, g, seq)
        return tf.GptOssForCausalLM(cfg), (), {"input_ids": ids, "labels": ids}
    if name == "hf_deepseek_v3":  # low-rank latent attention, a dense layer then routed experts
        cfg = tf.DeepseekV3Config(**decoder, num_key_value_heads=4, moe_intermediate_size=16,
                                  n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                  first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8,
                                  qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
        ids = _lm_batch(batch, g, seq)
        return tf.DeepseekV3ForCausalLM(cfg), (), {"input_ids": ids, "labels": ids}
    if name == "hf_qwen3_next":  # gated delta-rule linear attention, then full attention; experts
        cfg = tf.Qwen3NextConfig(**decoder, num_key_value_heads=2, head_dim=8, num_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=16,
                                 shared_expert_intermediate_size=16, linear_num_value_heads=2,
                                 linear_num_key_heads=2, linear_key_head_dim=8,
                                 linear_value_head_dim=8,
                                 layer_types=["linear_attention", "full_attention"])
        ids = _lm_batch(batch, g, seq)
        return tf.Qwen3NextForCausalLM(cfg), (), {"input_ids": ids, "labels": ids}
    if name == "hf_wav2vec2_ctc":  # speech recognition: CTC over labels padded with -100
        cfg = tf.Wav2Vec2Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                num_attention_heads=4, conv_dim=[16, 16], conv_stride=[5, 2],
                                conv_kernel=[10, 3], num_conv_pos_embeddings=16,
                                num_conv_pos_embedding_groups=4, mask_time_prob=0.0,
                                layerdrop=0.0, vocab_size=12, hidden_dropout=0.0,
                                attention_dropout=0.0, activation_dropout=0.0,
                                feat_proj_dropout=0.0, final_dropout=0.0)  # ctc_loss_reduction "sum"
        labels = torch.randint(1, 12, (batch, 6), generator=g)
        for i in range(batch):
            labels[i, 3 + i % 3:] = -100  # transcripts of other lengths
        return tf.Wav2Vec2ForCTC(cfg), (), {"input_values": torch.randn(batch, 400, generator=g),
                                            "labels": labels}
    if name == "hf_llama_cls":  # padded rows and their attention_mask; the last real token's logits
        cfg = tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                             max_position_embeddings=32, use_cache=False, pad_token_id=0,
                             num_labels=3)
        ids = _lm_batch(batch, g, seq).clamp(min=1)
        mask = torch.ones(batch, seq, dtype=torch.long)
        for i in range(batch):
            mask[i, seq - 1 - i % 4:] = 0  # right padding of other lengths
        return tf.LlamaForSequenceClassification(cfg), (), {
            "input_ids": ids * mask, "attention_mask": mask,
            "labels": torch.randint(0, 3, (batch,), generator=g)}
    if name == "hf_funnel":  # pooled along the sequence; x.new_ones for its [CLS] mask
        cfg = tf.FunnelConfig(vocab_size=VOCAB, block_sizes=[1, 1], n_head=2, d_model=32, d_head=8,
                              d_inner=64, num_decoder_layers=1, hidden_dropout=0.0,
                              attention_dropout=0.0, activation_dropout=0.0, num_labels=3)
        return tf.FunnelForSequenceClassification(cfg), (), {
            "input_ids": _lm_batch(batch, g, seq), "labels": torch.randint(0, 3, (batch,), generator=g)}
    raise KeyError(name)


NAMES = ["hf_bert", "hf_gpt2", "hf_llama", "hf_t5", "hf_vit", "hf_swin", "hf_convbert", "hf_mixtral",
         "hf_gpt_oss", "hf_deepseek_v3", "hf_qwen3_next", "hf_wav2vec2_ctc", "hf_funnel",
         "hf_llama_cls"]
