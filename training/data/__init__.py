"""User conversation files for drafter training (LLaVA-Instruct / ShareGPT4V format): read, check, turn into chat
messages, and export the embedded world as such a file. The format and its rules: docs/training-data.md.

    convs = load_conversations("llava_instruct.json", image_root="coco/", tokenizer=tok, max_tokens=2048)
    for ex in exchanges(convs[0]):        # one per assistant turn: the prompt messages before it, and its answer
        text = processor.apply_chat_template(ex.messages, tokenize=False, add_generation_prompt=True)
        images = load_images(convs[0])[: ex.n_images]
"""

from specula.training.data.checks import check_images, check_lengths, load_conversations, validate
from specula.training.data.conversations import (Conversation, DataError, Problem, Turn, read_conversations, to_record,
                                                 write_records)
from specula.training.data.messages import Exchange, exchanges, load_images, to_messages
from specula.training.data.world_export import world_samples, write_world_conversations

__all__ = ["Conversation", "DataError", "Exchange", "Problem", "Turn", "check_images", "check_lengths", "exchanges",
           "load_conversations", "load_images", "read_conversations", "to_messages", "to_record", "validate",
           "world_samples", "write_records", "write_world_conversations"]
