variable "region" {
  type = string
}

output "vpc" {
  value = "vpc-${var.region}"
}
