"""Tokens: a chat's views tokenised and labelled (`labels`), the loss's static weights of a split (`weights`), a
tokenised split's columns read in one go (`columns`), what a batch holds: the label without a loss and the samples
of a packed row (`batch`), and the collator that pads or packs them with each token's weight (`collator`).

    Views("<|im_start|>user ...", spans=[(41, 46)])  ->  input_ids, labels (-100 off the answers)  ->  a batch

May import: `config base`, `sft.data.rows`, `sft.data.spec`, `sft.data.chat`."""
